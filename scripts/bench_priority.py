"""Priority isolation: a high-priority caller's latency while 32 low-priority callers saturate servex.

    python scripts/bench_priority.py [--seconds 8] [--workdir /tmp/servex-bench] [--servex_flag=--enable_batching]

Serves the kit's MLP; h2load (Debian package nghttp2-client) keeps 32 batch-1 Predict calls in flight at the
default priority 0, while one Python caller sends batch-1 Predict calls with `x-servex-priority: 10`, one at a
time. Prints that caller's p50/p99 on the idle server and under the flood (goal: p99 under load at most 2x idle).

``--width N`` serves instead an MLP of the same shape and names with N units per layer (exported here): with a
large N each run, not each call, is what costs, which is the case a run scheduler can isolate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT = REPO.parent / "shared" / "bench"
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc  # noqa: E402

from scripts.wide_mlp import export_wide_mlp  # noqa: E402
from tests.support.daemon import Daemon  # noqa: E402

METHOD = "/tensorflow.serving.PredictionService/Predict"


def latencies_ms(stub, req, seconds: float, metadata) -> list[float]:
    out, stop = [], time.monotonic() + seconds
    while time.monotonic() < stop:
        t0 = time.perf_counter()
        stub.Predict(req, timeout=30, metadata=metadata)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def summary(values: list[float]) -> str:
    q = statistics.quantiles(values, n=100)
    return f"p50 {q[49]:.2f} ms, p99 {q[98]:.2f} ms ({len(values)} calls)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servex-bench"))
    ap.add_argument("--servex_flag", action="append", default=[])
    ap.add_argument("--width", type=int, default=0, help="units per layer of an MLP exported here; 0: the kit's MLP")
    a = ap.parse_args()
    work = Path(a.workdir)
    subprocess.run([sys.executable, str(KIT / "make_models.py"), str(work), "mlp"], check=True, capture_output=True)
    model = work / "mlp"
    if a.width:
        model = work / f"mlp_width{a.width}"
        export_wide_mlp(model / "1", a.width)
    req = predict_pb2.PredictRequest()
    req.model_spec.name = "mlp"
    req.inputs["features"].CopyFrom(tf.make_tensor_proto(np.random.default_rng(0).random((1, 64), np.float32)))
    payload = req.SerializeToString()
    frame = work / "predict.grpc"
    frame.write_bytes(b"\0" + struct.pack(">I", len(payload)) + payload)
    daemon = Daemon([f"--model_base_path={model}", "--model_name=mlp", *a.servex_flag], work).wait_serving()
    stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
    high = (("x-servex-priority", "10"),)
    try:
        latencies_ms(stub, req, 1, high)  # warm up
        idle = latencies_ms(stub, req, a.seconds, high)
        flood = subprocess.Popen(
            ["h2load", f"http://127.0.0.1:{daemon.port}{METHOD}", "-d", str(frame), "-c", "4", "-m", "8",
             "-D", str(int(a.seconds) + 3), "-H", "content-type: application/grpc", "-H", "te: trailers"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        time.sleep(1.5)
        loaded = latencies_ms(stub, req, a.seconds, high)
        out = flood.communicate()[0]
        rps = next((line for line in out.splitlines() if "req/s" in line and "finished" in line), "")
        print(f"model: {model.name}; servex flags: {' '.join(a.servex_flag) or '(none)'}")
        print(f"high priority, idle server:      {summary(idle)}")
        print(f"high priority, 32 low callers:   {summary(loaded)}")
        print(f"low-priority flood: {rps.strip()}")
        ratio = statistics.quantiles(loaded, n=100)[98] / statistics.quantiles(idle, n=100)[98]
        print(f"p99 under load / p99 idle: {ratio:.2f}x (goal: at most 2x)")
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
