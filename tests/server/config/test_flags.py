"""docs/flags.md, `servex --help` and the parser come from the flags' one declaration (server/config/flags.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servex.server.cli import parse_settings
from servex.server.config import flags, triton_flags
from servex.server.config.flagspec import parse_bool
from servex.server.config.settings import ServerSettings
from tests.conftest import REPO

DOC = REPO / "docs" / "flags.md"


def test_docs_flags_md_is_generated_from_the_declarations():
    command = [sys.executable, "-m", "servex.server.config.flags", "--markdown"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout == flags.markdown()
    assert DOC.read_text(encoding="utf-8") == out.stdout, (
        f"docs/flags.md does not match the flags' declarations: regenerate it with `{flags.REGENERATE}` "
        "(from the repository's root)"
    )


def test_every_flag_of_the_parser_is_in_the_docs_and_help():
    doc = DOC.read_text(encoding="utf-8")
    parser = flags.build_parser()
    help_text = parser.format_help()
    declared = [spec for _, group in flags.flag_groups() for spec in group]
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                assert f"`{option}`" in doc, f"{option} missing from docs/flags.md"
    for spec in declared:
        if not spec.hidden:
            assert f"--{spec.name}" in help_text, f"--{spec.name} missing from --help"
    names = [name for spec in declared for name in (spec.name, *spec.aliases)]
    assert len(names) == len(set(names)), "a flag is declared twice"


def test_defaults_are_the_settings_defaults():
    assert parse_settings([]).settings == ServerSettings()


def test_counterparts_name_declared_flags():
    servex = {spec.name: spec for spec in flags.servex_flags()}
    for spec in triton_flags.FLAGS:
        assert not spec.sets or spec.sets in servex, f"--{spec.name} sets an unknown flag --{spec.sets}"
    for spec in servex.values():
        assert spec.tfserving in (True, False) or spec.tfserving in spec.aliases, spec.name


@pytest.mark.parametrize("spec", [s for s in flags.servex_flags() if s.type is parse_bool], ids=lambda s: s.name)
def test_every_boolean_flag_takes_the_three_forms(spec):
    parser = flags.build_parser()
    for argv, value in (([f"--{spec.name}"], True), ([f"--{spec.name}=true"], True), ([f"--{spec.name}=false"], False)):
        assert getattr(parser.parse_args(argv), spec.destination) is value, argv
