"""One KServe v2 ModelInferStream carrying many batch-1 requests, against the same requests as unary calls.

    python scripts/bench_stream.py [--model_dir /tmp/servex-bench/mlp] [--requests 4000] [--rounds 3] [-- SERVEX FLAGS]

Starts servex (with --enable_batching unless flags are given after --) on the kit's MLP (exported with
../shared/bench/make_models.py when --model_dir does not exist), then per round: one stream sending --requests
batch-1 ModelInfer requests as fast as gRPC takes them (the raw generated stub, so the client's Python costs
little), and the same number of unary calls from one caller, one after another. Prints one JSON line per round
(requests/s of each, mean batch size servex formed for the stream) and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

from tests.support.daemon import Daemon, metric  # noqa: E402

KIT = REPO.parent / "shared" / "bench" / "make_models.py"


def request(i: int) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name="mlp", id=str(i))
    req.inputs.add(name="features", datatype="FP32", shape=[1, 64])
    req.raw_input_contents.append(np.full((1, 64), i % 7, np.float32).tobytes())
    return req


def batches(daemon: Daemon) -> tuple[float, float]:
    return tuple(metric(daemon, f"servex_batch_size_{part}", model="mlp") for part in ("sum", "count"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_dir", default="/tmp/servex-bench/mlp")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("servex_flags", nargs="*")
    a = ap.parse_args()
    model = Path(a.model_dir)
    if not model.exists():
        subprocess.run([sys.executable, str(KIT), str(model.parent), "mlp"], check=True)
    flags = a.servex_flags or ["--enable_batching"]
    daemon = Daemon([f"--model_base_path={model}", "--model_name=mlp", *flags], Path(tempfile.mkdtemp()))
    rows = []
    try:
        daemon.wait_serving()
        stub = service_pb2_grpc.GRPCInferenceServiceStub(daemon.channel)
        reqs = [request(i) for i in range(a.requests)]
        stub.ModelInfer(reqs[0], timeout=30)  # the client graph is built once
        for _ in range(a.rounds):
            before = batches(daemon)
            start = time.perf_counter()
            answers = list(stub.ModelStreamInfer(iter(reqs), timeout=600))
            stream_s = time.perf_counter() - start
            after = batches(daemon)
            assert [x.infer_response.id for x in answers] == [r.id for r in reqs]
            assert not any(x.error_message for x in answers)
            start = time.perf_counter()
            for r in reqs:
                stub.ModelInfer(r, timeout=30)
            unary_s = time.perf_counter() - start
            row = {
                "stream_req_s": round(a.requests / stream_s),
                "unary_one_caller_req_s": round(a.requests / unary_s),
                "stream_mean_batch": round((after[0] - before[0]) / max(1.0, after[1] - before[1]), 2),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        daemon.stop()
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(json.dumps({"median": medians, "flags": flags}))


if __name__ == "__main__":
    main()
