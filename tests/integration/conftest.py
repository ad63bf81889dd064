from __future__ import annotations

from pathlib import Path

import pytest
import tensorflow as tf

from tests.integration.daemon import Daemon


@pytest.fixture(scope="module")
def start_daemon(tmp_path_factory):
    """Start servex daemons for this module; each is stopped (SIGTERM) at module end."""
    started: list[Daemon] = []

    def start(*args: str, rest: bool = False, credentials=None) -> Daemon:
        daemon = Daemon(list(args), tmp_path_factory.mktemp("servex"), rest=rest, credentials=credentials)
        started.append(daemon)
        return daemon.wait_serving()

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory) -> Path:
    """A model whose run takes as long as the caller asks: it counts to ``iterations`` in a while loop."""

    class Slow(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([], tf.int64, name="iterations")])
        def serve(self, iterations):
            _, count = tf.while_loop(
                lambda i, c: i < iterations,
                lambda i, c: (i + 1, c + 1),
                (tf.constant(0, tf.int64), tf.constant(0, tf.int64)),
            )
            return {"count": count}

    base = tmp_path_factory.mktemp("slow")
    module = Slow()
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.serve})
    return base


@pytest.fixture(scope="session")
def mlp_model(tmp_path_factory) -> Path:
    """The benchmark MLP (float32 ``features`` [None,64] -> ``score`` [None,1]) exported by the benchmark kit's
    own ``make_models.py``; returns its base path (version 1 inside)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    out = tmp_path_factory.mktemp("bench_models")
    script = REPO.parent / "shared" / "bench" / "make_models.py"
    subprocess.run([sys.executable, str(script), str(out), "mlp"], check=True, capture_output=True)
    return out / "mlp"


def export_sum(path):
    """x [None,3] float32 -> doubled [None,3] and total (a scalar: no batch dimension, so never batched)."""

    class Sum(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def serve(self, x):
            return {"doubled": x * 2.0, "total": tf.reduce_sum(x)}

    module = Sum()
    tf.saved_model.save(module, str(path / "1"), signatures={"serving_default": module.serve})


@pytest.fixture(scope="session")
def sum_model(tmp_path_factory) -> Path:
    """``export_sum``'s model; returns its base path (version 1 inside)."""
    base = tmp_path_factory.mktemp("sum_model") / "sum"
    export_sum(base)
    return base
