"""--device through the real daemon: errors at start, the auto fallback, and the transfer metrics on /metrics."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.clients import predict_outputs
from tests.support.daemon import metric, run_to_exit
from tests.transfer.gpu import without_gpu


@pytest.fixture(scope="module")
def daemon(start_daemon, mlp_model):
    return start_daemon(f"--model_base_path={mlp_model}", "--model_name=mlp", "--device=auto")


def score(daemon, features: np.ndarray) -> np.ndarray:
    return predict_outputs(daemon.channel, "mlp", {"features": features})["score"]


@without_gpu
def test_gpu_without_cupy_fails_at_start_saying_what_is_missing():
    outcome = run_to_exit(["--device=gpu:0"])
    output = outcome.stdout + outcome.stderr
    assert outcome.returncode == 1, output
    assert "--device=gpu:0 needs CuPy" in output or "--device=gpu:0: CuPy is installed but CUDA" in output
    assert "Traceback" not in output


@pytest.mark.parametrize("device", ["tpu", "gpu:x", "cpu:"])
def test_an_unknown_device_fails_at_start(device):
    outcome = run_to_exit([f"--device={device}"])
    output = outcome.stdout + outcome.stderr
    assert outcome.returncode == 1, output
    assert f"unknown device {device!r}" in output and "'gpu'" in output and "'auto'" in output
    assert "Traceback" not in output


@without_gpu
def test_auto_serves_on_the_cpu_and_logs_the_fallback(daemon):
    log = daemon.log()
    assert "--device=auto" in log and "falling back to cpu" in log
    assert "transfer executor: cpu" in log
    assert score(daemon, np.ones((2, 64), np.float32)).shape == (2, 1)


@without_gpu
def test_predict_counts_the_bytes_it_fed_and_one_transfer(daemon):
    rows = np.random.default_rng(1).random((4, 64), np.float32)
    score(daemon, rows)  # the first run also restores (and transfers) the variables
    fed = metric(daemon, "servex_h2d_bytes_total", device="cpu")
    runs = metric(daemon, "servex_h2d_transfer_seconds_count", device="cpu")
    assert fed > 0 and runs >= 1
    score(daemon, rows)
    assert metric(daemon, "servex_h2d_bytes_total", device="cpu") - fed == rows.nbytes
    assert metric(daemon, "servex_h2d_transfer_seconds_count", device="cpu") - runs == 1


CLOSE = {"rtol": 1e-5, "atol": 1e-6}  # kernels for other batch sizes round differently


@without_gpu
def test_a_large_input_copied_aligned_gives_the_same_answers(daemon):
    """4096 x 64 float32 (1 MiB) arrives unaligned in tensor_content, so the executor copies it aligned."""
    rows = np.random.default_rng(2).random((4096, 64), np.float32)
    small = score(daemon, rows[:8])
    big = score(daemon, rows)
    assert big.shape == (4096, 1)
    np.testing.assert_allclose(big[:8], small, **CLOSE)
    np.testing.assert_allclose(big[-8:], score(daemon, rows[-8:]), **CLOSE)
