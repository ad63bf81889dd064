"""The daemon helpers' former home, kept importable: they live in tests/support/daemon.py now."""

from tests.support.daemon import (  # noqa: F401
    START_TIMEOUT_S,
    Daemon,
    free_port,
    listening_sockets,
    metric,
    model_config_file,
    port_clash,
    run_to_exit,
    terminate,
    wait_for,
)
