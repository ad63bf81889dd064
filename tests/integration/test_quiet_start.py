"""A quiet start: servex on its demo model, as a user starts it (no TF_CPP_MIN_LOG_LEVEL set, no GPU here), logs
no WARNING or ERROR line, neither its own nor TensorFlow's C++ ones; its first line says what it serves and where.
With TF_CPP_MIN_LOG_LEVEL set by the user, TensorFlow logs as it was told."""

from __future__ import annotations

import os
import re
import subprocess
import time

from tests.conftest import REPO
from tests.support.daemon import DAEMON_PYTHON
from tests.support.ports import free_port

READY_S = 120
# absl's C++ prefix (W1128 ..., E0000 ...), Python logging's level, or absl's pre-init banner
LOUD = re.compile(r"^[WEF]\d{4} | (WARNING|ERROR|CRITICAL) |^WARNING: All log messages")


def _start(tmp_path, env: dict[str, str]) -> list[str]:
    port, metrics = free_port(), free_port()
    log = tmp_path / "servex.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [DAEMON_PYTHON, "-m", "servex.server", f"--port={port}", f"--metrics_port={metrics}",
             "--rest_api_port=0", "--bind_address=127.0.0.1"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + READY_S
        while "servex ready on" not in log.read_text(errors="replace"):
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"not ready in {READY_S} s: {log.read_text()[-3000:]}"
            time.sleep(0.2)
    finally:
        process.terminate()
        process.wait(60)
    return log.read_text(errors="replace").splitlines()


def test_a_start_without_a_gpu_logs_no_warning_or_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    lines = _start(tmp_path, env)
    loud = [line for line in lines if LOUD.search(line)]
    assert not loud, "\n".join(loud)
    assert "servex" in lines[0] and "serving 'demo'" in lines[0] and "gRPC 127.0.0.1:" in lines[0], lines[0]


def test_tensorflow_logs_as_told_when_the_user_sets_its_level(tmp_path):
    lines = _start(tmp_path, dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0"))
    assert any(re.match(r"^I\d{4} ", line) for line in lines), "\n".join(lines[:20])
