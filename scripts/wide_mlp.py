"""The kit's MLP at another width, for the benchmark scripts: with wide layers each run, not each call, costs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf


def export_wide_mlp(path: Path, width: int) -> None:
    """The kit's MLP (``features`` [None,64] -> 3 ReLU layers -> ``score``) with ``width`` units per layer."""
    if (path / "saved_model.pb").exists():
        return
    rng = np.random.default_rng(0)
    dims = [64, width, width, width, 1]
    module = tf.Module()
    module.ws = [
        tf.Variable((rng.standard_normal((a, b)) / np.sqrt(a)).astype("float32"))
        for a, b in zip(dims, dims[1:], strict=False)
    ]
    module.bs = [tf.Variable(np.zeros(b, "float32")) for b in dims[1:]]

    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.float32, name="features")])
    def serve(features):
        h = features
        for i, (w, b) in enumerate(zip(module.ws, module.bs, strict=True)):
            h = tf.matmul(h, w) + b
            h = tf.nn.relu(h) if i < len(module.ws) - 1 else h
        return {"score": h}

    tf.saved_model.save(module, str(path), signatures={"serving_default": serve})
