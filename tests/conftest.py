"""Shared test paths, fixtures and markers.

TensorFlow Serving's own test models live in ../shared/models (relative to the project root); tests use them in
place and never copy them into the project. The helpers the tests share live in tests/support/; its fixtures
(tests/support/fixtures.py) are imported here, so every test can ask for them.

Markers (registered in pyproject.toml), applied here at collection: ``integration`` to every test under
tests/integration/ and to any other that starts the daemon (asks for a daemon fixture, or its module uses the
daemon helpers ``Daemon`` or ``run_to_exit``; a test that starts servex some other way carries the marker itself),
``deploy`` to every test under tests/deploy/. ``pytest -m "not integration and not deploy"`` runs the unit tests
alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import daemon as _daemon
from tests.support.fixtures import mlp_model, shared_daemon, slow_model, start_daemon, strings_model, sum_model
from tests.support.paths import (
    BAD_HALF_PLUS_TWO,
    COUNTER,
    EXPECTED,
    HALF_PLUS_THREE,
    HALF_PLUS_TWO_TF1,
    HALF_PLUS_TWO_TF2,
    REPO,
    TESTDATA,
    TWO_VERSIONS,
)

__all__ = [
    "BAD_HALF_PLUS_TWO",
    "COUNTER",
    "EXPECTED",
    "HALF_PLUS_THREE",
    "HALF_PLUS_TWO_TF1",
    "HALF_PLUS_TWO_TF2",
    "REPO",
    "TESTDATA",
    "TWO_VERSIONS",
    "mlp_model",
    "shared_daemon",
    "slow_model",
    "start_daemon",
    "strings_model",
    "sum_model",
]

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TESTS = Path(__file__).resolve().parent
BY_FOLDER = {"integration": "integration", "deploy": "deploy"}
DAEMON_FIXTURES = {"start_daemon", "shared_daemon"}
DAEMON_STARTERS = (_daemon.Daemon, _daemon.run_to_exit)


@pytest.fixture(scope="session")
def testdata() -> Path:
    if not TESTDATA.is_dir():
        pytest.fail(f"TensorFlow Serving's test models are missing: expected them at {TESTDATA}")
    return TESTDATA


def _starts_daemons(item: pytest.Item) -> bool:
    if DAEMON_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    module = getattr(item, "module", None)
    return module is not None and any(v is s for v in vars(module).values() for s in DAEMON_STARTERS)


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            folder = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        marker = BY_FOLDER.get(folder) or ("integration" if _starts_daemons(item) else None)
        if marker:
            item.add_marker(marker)
