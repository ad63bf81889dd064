"""servex's defaults follow the cores it may use: one caller's latency with servex confined to 1 core, then to 2
(``taskset``), default flags, in alternating rounds.

    python scripts/bench_cores.py [--model resnet50] [--cpus 0 0,1] [--requests 30] [--rounds 3] [--models_dir DIR]

The model comes from scripts/suite_models.py (exported into --models_dir unless there). servex starts under
``taskset -c CPUS`` with no flag but its ports; one caller sends ``--requests`` batch-1 KServe v2 ModelInfer calls
one after another (after 5 to warm up). Prints each round's mean latency per CPU set, then the medians and their
ratio to the first set's (the goal on 2 cores against 1: at most 0.6x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.bench_peers import free_port  # noqa: E402
from scripts.suite_models import MODELS, export  # noqa: E402

NUMPY = {"FP32": np.float32, "INT32": np.int32, "INT64": np.int64}


def infer_request(model) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model.name)
    rng = np.random.default_rng(0)
    for spec in model.inputs:
        value = (rng.random((1, *spec.row)) * spec.high).astype(NUMPY[spec.dtype])
        request.inputs.add(name=spec.name, datatype=spec.dtype, shape=value.shape)
        request.raw_input_contents.append(value.tobytes())
    return request


def one_caller(cpus: str, base: Path, model, requests: int, log: Path) -> float:
    """servex under ``taskset -c cpus``: one caller's mean latency in ms."""
    port = free_port()
    cmd = ["taskset", "-c", cpus, sys.executable, "-m", "servex.server", f"--model_name={model.name}",
           f"--model_base_path={base}", f"--port={port}", "--rest_api_port=0", "--metrics_port=0",
           "--bind_address=127.0.0.1"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 1 << 30)])
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        deadline = time.monotonic() + 180
        while True:
            try:
                if stub.ModelReady(service_pb2.ModelReadyRequest(name=model.name), timeout=2).ready:
                    break
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"servex did not serve; see {log}")
            time.sleep(0.5)
        request = infer_request(model)
        for _ in range(5):
            stub.ModelInfer(request, timeout=60)
        seconds = []
        for _ in range(requests):
            started = time.perf_counter()
            stub.ModelInfer(request, timeout=60)
            seconds.append(time.perf_counter() - started)
        channel.close()
        return 1000 * statistics.fmean(seconds)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    ap.add_argument("--cpus", nargs="+", default=["0", "0,1"])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models_dir", type=Path, default=Path(tempfile.gettempdir()) / "servex-suite")
    a = ap.parse_args()
    model = MODELS[a.model]
    base = export(a.models_dir, (a.model,))[a.model]
    means: dict[str, list[float]] = {cpus: [] for cpus in a.cpus}
    for round_ in range(a.rounds):
        for cpus in a.cpus:
            ms = one_caller(cpus, base, model, a.requests, a.models_dir / f"servex-cores-{cpus}.log")
            means[cpus].append(ms)
            print(
                json.dumps({"round": round_ + 1, "cpus": cpus, "model": a.model, "mean_ms": round(ms, 2)}), flush=True
            )
    first = statistics.median(means[a.cpus[0]])
    for cpus, values in means.items():
        median = statistics.median(values)
        print(f"taskset -c {cpus}: {a.model} 1-caller mean {median:.1f} ms (median of {len(values)}), "
              f"{median / first:.2f}x taskset -c {a.cpus[0]}")  # fmt: skip


if __name__ == "__main__":
    main()
