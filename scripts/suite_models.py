"""The benchmark model suite: real architectures with random weights (nothing is downloaded).

    python scripts/suite_models.py OUT [mlp] [resnet50] [mobilenet_v2] [transformer] [wide_deep] [efficientnet_b0] ...

Each model is exported as a TensorFlow Serving base path, ``OUT/NAME/1``; one already there is kept. ``MODELS``
says, for each, the request the benchmark sends (input name, shape of one row, dtype) and its output: ``SUITE``,
the suite the benchmark runs by default, and ``MORE``, other architectures to check the defaults on.

- ``mlp``: the benchmark kit's MLP (64 float features -> 3x256 ReLU -> score), exported by the kit itself.
- ``resnet50``, ``mobilenet_v2``: ``keras.applications`` with ``weights=None``, 224x224x3 float32 images.
- ``transformer``: a BERT-like encoder: int32 token ids [batch, 128], 4 layers, hidden 256, 4 heads, FFN 1024;
  answers the first token's final hidden state [batch, 256].
- ``wide_deep``: a recommender whose embedding table holds 1,100,000 x 64 float32 (282 MB): ``serving_default``
  takes dense features (``dense`` [batch, 13] float32, ``ids`` [batch, 8] int64) through Predict; ``classify``
  and ``regress`` take serialized ``tf.Example``s (features ``dense`` and ``ids``) through Classify and Regress.
- ``efficientnet_b0``, ``densenet121`` (``MORE``): ``keras.applications``, as the images above.
- ``gru`` (``MORE``): int32 token ids [batch, 64] -> embedding 128 -> GRU 256 -> score [batch, 1]: a recurrent
  network, whose run is a loop of 64 steps of small ops.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

KIT = Path(__file__).resolve().parents[2] / "shared" / "bench"


@dataclass(frozen=True)
class Input:
    name: str  # the Predict / ModelInfer input
    row: tuple[int, ...]  # one request's shape without the batch dimension
    dtype: str  # KServe v2 datatype: FP32, INT32, INT64
    high: int = 100  # values drawn from [0, high)


@dataclass(frozen=True)
class SuiteModel:
    name: str
    inputs: tuple[Input, ...]
    output: str
    unit: str  # what one request row is, for the tables


SUITE = {
    "mlp": SuiteModel("mlp", (Input("features", (64,), "FP32"),), "score", "requests"),
    "resnet50": SuiteModel("resnet50", (Input("images", (224, 224, 3), "FP32", 1),), "probabilities", "images"),
    "mobilenet_v2": SuiteModel("mobilenet_v2", (Input("images", (224, 224, 3), "FP32", 1),), "probabilities", "images"),
    "transformer": SuiteModel("transformer", (Input("token_ids", (128,), "INT32", 8192),), "pooled", "sequences"),
    "wide_deep": SuiteModel(
        "wide_deep", (Input("dense", (13,), "FP32", 1), Input("ids", (8,), "INT64", 1_100_000)), "score", "requests"
    ),
}
MORE = {
    "efficientnet_b0": SuiteModel("efficientnet_b0", SUITE["resnet50"].inputs, "probabilities", "images"),
    "densenet121": SuiteModel("densenet121", SUITE["resnet50"].inputs, "probabilities", "images"),
    "gru": SuiteModel("gru", (Input("token_ids", (64,), "INT32", 8192),), "score", "sequences"),
}
MODELS = {**SUITE, **MORE}
WIDE_DEEP_ROWS = 1_100_000  # x 64 float32: 282 MB
WIDE_DEEP_IDS = 8


def _tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    return tf


def _image_model(path: str, application) -> None:
    tf = _tf()
    model = application(weights=None, input_shape=(224, 224, 3))
    module = tf.Module()
    module.model = model

    @tf.function(input_signature=[tf.TensorSpec([None, 224, 224, 3], tf.float32, name="images")])
    def serve(images):
        return {"probabilities": model(images, training=False)}

    module.serve = serve
    tf.saved_model.save(module, path, signatures={"serving_default": serve})


def resnet50(path: str) -> None:
    _image_model(path, _tf().keras.applications.ResNet50)


def mobilenet_v2(path: str) -> None:
    _image_model(path, _tf().keras.applications.MobileNetV2)


def transformer(path: str, vocab=8192, length=128, hidden=256, heads=4, layers=4, ffn=1024) -> None:
    tf = _tf()
    keras = tf.keras
    ids = keras.Input((length,), dtype="int32", name="token_ids")
    positions = keras.layers.Embedding(length, hidden)(tf.range(length)[tf.newaxis, :])
    h = keras.layers.Embedding(vocab, hidden)(ids) + positions
    h = keras.layers.LayerNormalization(epsilon=1e-12)(h)
    for _ in range(layers):
        attention = keras.layers.MultiHeadAttention(heads, hidden // heads)(h, h)
        h = keras.layers.LayerNormalization(epsilon=1e-12)(h + attention)
        f = keras.layers.Dense(ffn, activation="gelu")(h)
        h = keras.layers.LayerNormalization(epsilon=1e-12)(h + keras.layers.Dense(hidden)(f))
    pooled = keras.layers.Dense(hidden, activation="tanh")(h[:, 0])
    model = keras.Model(ids, pooled)
    module = tf.Module()
    module.model = model

    @tf.function(input_signature=[tf.TensorSpec([None, length], tf.int32, name="token_ids")])
    def serve(token_ids):
        return {"pooled": model(token_ids, training=False)}

    module.serve = serve
    tf.saved_model.save(module, path, signatures={"serving_default": serve})


def wide_deep(path: str, rows=WIDE_DEEP_ROWS, dim=64, dense=13) -> None:
    tf = _tf()
    module = tf.Module()
    module.table = tf.Variable(tf.random.normal((rows, dim), stddev=0.05, seed=1), name="embeddings")
    module.wide = tf.Variable(tf.random.normal((dense, 1), stddev=0.1, seed=2), name="wide")
    sizes = [dense + dim, 256, 128, 1]
    module.ws = [tf.Variable(tf.random.normal((a, b), stddev=(2 / a) ** 0.5, seed=3 + i), name=f"w{i}")
                 for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False))]  # fmt: skip
    module.bs = [tf.Variable(tf.zeros((b,)), name=f"b{i}") for i, b in enumerate(sizes[1:])]

    def logit(dense_features, ids):
        embedded = tf.reduce_mean(tf.nn.embedding_lookup(module.table, ids % rows), axis=1)
        h = tf.concat([dense_features, embedded], axis=1)
        for i, (w, b) in enumerate(zip(module.ws, module.bs, strict=True)):
            h = tf.matmul(h, w) + b
            if i < len(module.ws) - 1:
                h = tf.nn.relu(h)
        return h + tf.matmul(dense_features, module.wide)

    spec = {
        "dense": tf.io.FixedLenFeature([dense], tf.float32),
        "ids": tf.io.FixedLenFeature([WIDE_DEEP_IDS], tf.int64),
    }

    @tf.function(input_signature=[tf.TensorSpec([None, dense], tf.float32, name="dense"),
                                  tf.TensorSpec([None, WIDE_DEEP_IDS], tf.int64, name="ids")])  # fmt: skip
    def serve(dense, ids):
        return {"score": tf.sigmoid(logit(dense, ids))}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def classify(inputs):
        features = tf.io.parse_example(inputs, spec)
        p = tf.sigmoid(logit(features["dense"], features["ids"]))
        return {"scores": tf.concat([1 - p, p], axis=1)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def regress(inputs):
        features = tf.io.parse_example(inputs, spec)
        return {"outputs": tf.sigmoid(logit(features["dense"], features["ids"]))}

    module.serve, module.classify, module.regress = serve, classify, regress
    signatures = {"serving_default": serve, "classify": classify, "regress": regress}
    tf.saved_model.save(module, path, signatures=signatures)


def efficientnet_b0(path: str) -> None:
    _image_model(path, _tf().keras.applications.EfficientNetB0)


def densenet121(path: str) -> None:
    _image_model(path, _tf().keras.applications.DenseNet121)


def gru(path: str) -> None:
    tf = _tf()
    keras = tf.keras
    ids = keras.Input((64,), dtype="int32", name="token_ids")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.GRU(256)(keras.layers.Embedding(8192, 128)(ids))))
    module = tf.Module()
    module.model = model

    @tf.function(input_signature=[tf.TensorSpec([None, 64], tf.int32, name="token_ids")])
    def serve(token_ids):
        return {"score": model(token_ids, training=False)}

    module.serve = serve
    tf.saved_model.save(module, path, signatures={"serving_default": serve})


def mlp(path: str) -> None:
    out = Path(path).parents[1]
    subprocess.run(
        [sys.executable, str(KIT / "make_models.py"), str(out), "mlp"], check=True, stdout=subprocess.DEVNULL
    )


def export(out: Path, names=tuple(SUITE)) -> dict[str, Path]:
    """Each named model under ``out/NAME`` (a base path; version 1), exported unless already there."""
    paths = {}
    for name in names:
        if name not in MODELS:
            raise SystemExit(f"no model {name!r} in the suite: {', '.join(MODELS)}")
        version = out / name / "1"
        if not (version / "saved_model.pb").exists():
            globals()[name](str(version))
        paths[name] = out / name
    return paths


if __name__ == "__main__":
    for name, base in export(Path(sys.argv[1]), sys.argv[2:] or tuple(SUITE)).items():
        print(name, base)
