"""The small SavedModels the tests export with TensorFlow (each exported once per session by tests/support/fixtures.py
where a fixture serves it), and the warm-up files written into copies of TensorFlow Serving's test models."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import tensorflow as tf
from tensorflow_serving.apis import prediction_log_pb2

from servex.loader.warmup_records import WARMUP_FILE
from tests.support.paths import HALF_PLUS_TWO_TF1, REPO

WARMUP_VERSION = 123  # the version of half_plus_two (TF1) that model_with_warmup copies


def save(module: tf.Module, path: Path, **signatures) -> None:
    """Save ``module`` as version 1 under base path ``path`` with these signatures (``serving_default`` among
    them)."""
    tf.saved_model.save(module, str(Path(path) / "1"), signatures=signatures)


def tanh_loop(x, weights, steps: int = 1000):
    """``steps`` steps of h = tanh(h W + x) from h = x, in a while loop: a run of many ops too small to split over
    threads."""
    return tf.while_loop(lambda i, h: i < steps, lambda i, h: (i + 1, tf.tanh(h @ weights + x)), (0, x))[1]


def export_slow(path: Path) -> None:
    """A model whose run takes as long as the caller asks: it counts to ``iterations`` (int64 scalar) in a while loop
    and answers ``count``."""

    class Slow(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([], tf.int64, name="iterations")])
        def serve(self, iterations):
            _, count = tf.while_loop(
                lambda i, c: i < iterations,
                lambda i, c: (i + 1, c + 1),
                (tf.constant(0, tf.int64), tf.constant(0, tf.int64)),
            )
            return {"count": count}

    module = Slow()
    save(module, path, serving_default=module.serve)


def export_sum(path: Path) -> None:
    """x [None,3] float32 -> doubled [None,3] and total (a scalar: no batch dimension, so never batched)."""

    class Sum(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def serve(self, x):
            return {"doubled": x * 2.0, "total": tf.reduce_sum(x)}

    module = Sum()
    save(module, path, serving_default=module.serve)


def export_strings(path: Path) -> None:
    """text [None] string -> length (int32) and upper (string)."""

    class Strings(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
        def serve(self, text):
            return {"length": tf.strings.length(text), "upper": tf.strings.upper(text)}

    module = Strings()
    save(module, path, serving_default=module.serve)


def export_mlp(out: Path) -> Path:
    """The benchmark MLP (float32 ``features`` [None,64] -> ``score`` [None,1]) exported by the benchmark kit's own
    ``make_models.py`` into ``out``; returns its base path (version 1 inside)."""
    script = REPO.parent / "shared" / "bench" / "make_models.py"
    subprocess.run([sys.executable, str(script), str(out), "mlp"], check=True, capture_output=True)
    return out / "mlp"


def write_warmup_file(version: Path, records: list[bytes]) -> None:
    """The version's warm-up file, holding these raw records."""
    (version / WARMUP_FILE).parent.mkdir(parents=True)
    with tf.io.TFRecordWriter(str(version / WARMUP_FILE)) as writer:
        for record in records:
            writer.write(record)


def as_log(request) -> prediction_log_pb2.PredictionLog:
    """A PredictionLog record of a Predict, Classify, Regress or MultiInference request."""
    kinds = {"PredictRequest": "predict_log", "ClassificationRequest": "classify_log",
             "RegressionRequest": "regress_log", "MultiInferenceRequest": "multi_inference_log"}  # fmt: skip
    kind = kinds[type(request).__name__]
    record = prediction_log_pb2.PredictionLog()
    getattr(record, kind).request.CopyFrom(request)
    return record


def model_with_warmup(base: Path, records: list[bytes]) -> Path:
    """A copy of half_plus_two (TF1) whose version (``WARMUP_VERSION``) holds a warm-up file of these raw records."""
    version = base / str(WARMUP_VERSION)
    shutil.copytree(HALF_PLUS_TWO_TF1 / "00000123", version, copy_function=shutil.copyfile)
    for root, _dirs, _files in os.walk(base):
        os.chmod(root, 0o755)
    write_warmup_file(version, records)
    return base
