from __future__ import annotations

import pytest

from tests.integration.daemon import Daemon


@pytest.fixture(scope="module")
def start_daemon(tmp_path_factory):
    """Start servex daemons for this module; each is stopped (SIGTERM) at module end."""
    started: list[Daemon] = []

    def start(*args: str) -> Daemon:
        daemon = Daemon(list(args), tmp_path_factory.mktemp("servex"))
        started.append(daemon)
        return daemon.wait_serving()

    yield start
    for daemon in started:
        daemon.stop()
