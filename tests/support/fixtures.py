"""The fixtures every test may use (tests/conftest.py imports them): daemon starts and the exported models (each
exported once per session; TensorFlow is imported only when one is asked for)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.daemon import Daemon


def _starter(tmp_path_factory):
    started: list[Daemon] = []

    def start(
        *args: str, rest: bool = False, credentials=None, port_flags=(), wait: bool = True, spare: bool = True
    ) -> Daemon:
        daemon = Daemon(list(args), tmp_path_factory.mktemp("servex"), rest=rest, credentials=credentials,
                        port_flags=port_flags, spare=spare)  # fmt: skip
        started.append(daemon)
        return daemon.wait_serving() if wait else daemon

    return start, started


@pytest.fixture(scope="module")
def start_daemon(tmp_path_factory):
    """Start servex daemons for this module (``Daemon``'s arguments; the flags as positional arguments), each in a
    spare process that has imported TensorFlow already (tests/support/daemon.py) and waited SERVING (with
    ``wait=False``: started only, for the caller to start others beside it and call ``wait_serving`` on each;
    with ``spare=False``: a fresh process, and no spare starts to import TensorFlow beside the test, for tests
    that measure CPU time); each is stopped (SIGTERM) at module end."""
    start, started = _starter(tmp_path_factory)
    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture(scope="session")
def shared_daemon(tmp_path_factory):
    """A daemon per set of arguments (as ``start_daemon`` takes them) for the whole session: modules that ask for
    the same flags get the same process. For tests that leave it as they found it (no reloads, no stopping)."""
    start, started = _starter(tmp_path_factory)
    by_args: dict[tuple, Daemon] = {}

    def get(*args: str, rest: bool = False) -> Daemon:
        key = (args, rest)
        if key not in by_args or by_args[key].proc.poll() is not None:
            by_args[key] = start(*args, rest=rest)
        return by_args[key]

    yield get
    for daemon in started:
        daemon.stop()


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory) -> Path:
    """``models.export_slow``'s model: a run as long as the caller asks; returns its base path (version 1 inside).
    Its daemons run with ``--xla=false``: its counting loop would try XLA's program (a loop: executor/xla_programs.py),
    which counts to the same answer in far less time than the runs the tests hold a worker with."""
    from tests.support import models

    base = tmp_path_factory.mktemp("slow")
    models.export_slow(base)
    return base


@pytest.fixture(scope="session")
def mlp_model(tmp_path_factory) -> Path:
    """The benchmark MLP (float32 ``features`` [None,64] -> ``score`` [None,1]) exported by the benchmark kit's
    own ``make_models.py``; returns its base path (version 1 inside)."""
    from tests.support import models

    return models.export_mlp(tmp_path_factory.mktemp("bench_models"))


@pytest.fixture(scope="session")
def sum_model(tmp_path_factory) -> Path:
    """``models.export_sum``'s model; returns its base path (version 1 inside)."""
    from tests.support import models

    base = tmp_path_factory.mktemp("sum_model") / "sum"
    models.export_sum(base)
    return base


@pytest.fixture(scope="session")
def strings_model(tmp_path_factory) -> Path:
    """``models.export_strings``'s model; returns its base path (version 1 inside)."""
    from tests.support import models

    base = tmp_path_factory.mktemp("strings_model") / "strings"
    models.export_strings(base)
    return base
