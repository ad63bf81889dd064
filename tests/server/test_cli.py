"""The command line: flags become typed settings; impossible values stop at parse time with a message."""

from __future__ import annotations

import pytest

from server.cli import parse_settings
from server.settings import ServerSettings


def test_grpc_listeners_default_and_flag():
    assert parse_settings([])[0].grpc_listeners == ServerSettings().grpc_listeners == 8
    assert parse_settings(["--grpc_listeners=2"])[0].grpc_listeners == 2


@pytest.mark.parametrize("flag", ["--grpc_listeners", "--serving_processes"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_count_below_one_is_refused_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        parse_settings([f"{flag}={value}"])
    assert info.value.code == 2
    assert f"{flag} must be at least 1, got {value}" in capsys.readouterr().err
