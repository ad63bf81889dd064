"""Throughput and latency of servex's TensorFlow Serving Predict, with the shared benchmark kit's h2load driver.

    python scripts/bench_predict.py [--seconds 8] [--concurrency 1,8,32] [--workdir /tmp/servex-bench] [--tls]
                                    [--width N] [--servex_flag=--enable_batching]

Exports the kit's MLP (64 float features -> 3x256 ReLU -> score) with ../shared/bench/make_models.py, starts
servex on it on loopback, sends batch-1 PredictRequests (tensor_content) through h2load
(Debian package nghttp2-client) at each concurrency and prints one JSON line per level. A Python client checks
the answer first, since h2load only counts HTTP-level success. With ``--tls`` servex serves gRPC over TLS
(--ssl_config_file, certificates made for the run by tests/certificates.py) and h2load speaks it (h2 by ALPN; it
does not check the certificate); each of its connections makes one handshake, in the warm-up second.
``--width N`` serves the same MLP with N units per layer instead (exported here, scripts/wide_mlp.py): with a large
N each run, not each call, is what costs.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT = REPO.parent / "shared" / "bench"
sys.path.insert(0, str(KIT))
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import h2grpc  # noqa: E402  (the shared kit's driver)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from h2grpc import run as h2load_run  # noqa: E402
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc  # noqa: E402

from scripts.wide_mlp import export_wide_mlp  # noqa: E402
from tests.support.daemon import Daemon  # noqa: E402


class _Https:
    """The subprocess module as the kit's h2grpc sees it, with h2load's URL switched to https: the kit's driver
    (its command, connections, warm-up and parsing, unchanged) over TLS, where it speaks h2c only."""

    def __getattr__(self, name):
        return getattr(subprocess, name)

    @staticmethod
    def run(command, **kwargs):
        return subprocess.run([command[0], command[1].replace("http://", "https://", 1), *command[2:]], **kwargs)


def h2load_tls(*args) -> dict:
    h2grpc.subprocess = _Https()
    try:
        return h2load_run(*args)
    finally:
        h2grpc.subprocess = subprocess


METHOD = "/tensorflow.serving.PredictionService/Predict"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servex-bench"))
    ap.add_argument("--servex_flag", action="append", default=[], help="extra servex flag, repeatable")
    ap.add_argument("--tls", action="store_true", help="gRPC over TLS (--ssl_config_file)")
    ap.add_argument("--width", type=int, default=0, help="units per layer of an MLP exported here; 0: the kit's MLP")
    a = ap.parse_args()
    work = Path(a.workdir)
    subprocess.run([sys.executable, str(KIT / "make_models.py"), str(work), "mlp"], check=True, capture_output=True)
    model = work / "mlp"
    if a.width:
        model = work / f"mlp_width{a.width}"
        export_wide_mlp(model / "1", a.width)

    x = np.random.default_rng(0).random((1, 64), dtype=np.float32)
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "mlp"
    req.inputs["features"].CopyFrom(tf.make_tensor_proto(x))
    payload = req.SerializeToString()
    frame = work / "predict.grpc"
    frame.write_bytes(b"\0" + struct.pack(">I", len(payload)) + payload)

    flags, credentials = [*a.servex_flag], None
    if a.tls:
        import grpc

        from tests.certificates import Authority, ssl_config

        authority = Authority()
        (work / "ssl.config").write_text(ssl_config(authority.server()))
        flags.append(f"--ssl_config_file={work / 'ssl.config'}")
        credentials = grpc.ssl_channel_credentials(authority.cert.encode())
    daemon = Daemon([f"--model_base_path={model}", "--model_name=mlp", *flags], work,
                    credentials=credentials).wait_serving()  # fmt: skip
    try:
        reply = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel).Predict(req, timeout=30)
        assert tf.make_ndarray(reply.outputs["score"]).shape == (1, 1), reply
        for c in (int(v) for v in a.concurrency.split(",")):
            drive = h2load_tls if a.tls else h2load_run
            result = drive(daemon.port, str(frame), c, a.seconds, METHOD)
            result["label"] = ("servex Predict " + " ".join(a.servex_flag) + (" TLS" if a.tls else "")
                               + (f" width {a.width}" if a.width else ""))  # fmt: skip
            print(json.dumps(result), flush=True)
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
