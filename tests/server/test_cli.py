"""The command line: flags become typed settings; impossible values stop at parse time with a message."""

from __future__ import annotations

import os

import pytest

from servex.executor.cost_model import COMPUTE_BOUND_RUNS
from servex.server.cli import parse_settings
from servex.server.config.settings import ServerSettings


def test_grpc_listeners_default_and_flag():
    assert parse_settings([])[0].grpc_listeners == ServerSettings().grpc_listeners == 32
    assert parse_settings(["--grpc_listeners=2"])[0].grpc_listeners == 2


@pytest.mark.parametrize(
    "flag",
    ["--grpc_listeners", "--serving_processes", "--num_request_iterations_for_warmup", "--auto_compute_bound_runs"],
)
@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_count_below_one_is_refused_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        parse_settings([f"{flag}={value}"])
    assert info.value.code == 2
    assert f"{flag} must be at least 1, got {value}" in capsys.readouterr().err


def test_compute_bound_runs_default_is_the_run_handlers_and_a_flag_sets_it():
    assert parse_settings([])[0].auto_compute_bound_runs == COMPUTE_BOUND_RUNS == 2
    assert parse_settings(["--auto_compute_bound_runs=1"])[0].auto_compute_bound_runs == 1


def test_model_warmup_defaults_and_flags():
    settings = parse_settings([])[0]
    assert settings.enable_model_warmup is True and settings.num_request_iterations_for_warmup == 1
    settings = parse_settings(["--enable_model_warmup=false", "--num_request_iterations_for_warmup=3"])[0]
    assert settings.enable_model_warmup is False and settings.num_request_iterations_for_warmup == 3


def test_event_loop_cpu_default_off_and_flag():
    assert parse_settings([])[0].event_loop_cpu == ServerSettings().event_loop_cpu == -1
    last = len(os.sched_getaffinity(0)) - 1
    assert parse_settings([f"--event_loop_cpu={last}"])[0].event_loop_cpu == last


def test_an_event_loop_cpu_past_the_allowed_ones_is_refused_naming_them(capsys):
    count = len(os.sched_getaffinity(0))
    with pytest.raises(SystemExit) as info:
        parse_settings([f"--event_loop_cpu={count}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"--event_loop_cpu={count}: this process may run on {count} CPU(s) (" in err
    assert f"give an index from 0 to {count - 1}" in err


def test_lower_priority_burst_default_and_flag():
    assert parse_settings([])[0].lower_priority_burst == ServerSettings().lower_priority_burst == 1
    assert parse_settings(["--lower_priority_burst=0"])[0].lower_priority_burst == 0
    assert parse_settings(["--lower_priority_burst=4"])[0].lower_priority_burst == 4


def test_a_negative_lower_priority_burst_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        parse_settings(["--lower_priority_burst=-1"])
    assert info.value.code == 2
    assert "--lower_priority_burst must be 0 (off) or more, got -1" in capsys.readouterr().err


def test_max_queued_bytes_default_flag_and_negative(capsys):
    assert parse_settings([])[0].max_queued_bytes == ServerSettings().max_queued_bytes == 0
    assert parse_settings(["--max_queued_bytes=1048576"])[0].max_queued_bytes == 1048576
    with pytest.raises(SystemExit):
        parse_settings(["--max_queued_bytes=-1"])
    assert "--max_queued_bytes must be 0 (no bound) or more, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "second", "first"),
    [
        (["--port=9000", "--metrics_port=9000"], "--metrics_port", "--port"),
        (["--rest_api_port=9001", "--metrics_port=9001"], "--metrics_port", "--rest_api_port"),
        (["--port=9002", "--admin_port=9002"], "--admin_port", "--port"),
    ],
)
def test_two_of_servexs_own_ports_on_one_number_are_refused_naming_both(flags, second, first, capsys):
    with pytest.raises(SystemExit) as info:
        parse_settings(flags)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{second}=" in err and f"is also {first}'s port" in err and "bind port" in err


def test_ports_turned_off_never_clash():
    settings = parse_settings(["--rest_api_port=0", "--metrics_port=0"]).settings
    assert (settings.rest_api_port, settings.metrics_port) == (0, 0)
