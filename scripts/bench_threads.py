"""Which intra-op thread count suits a model: TensorFlow in process, one fresh process per model and thread count.

Each child loads the model's SavedModel (one of scripts/suite_models.py's, exported if missing, or any SavedModel
version directory given as a path: its inputs are then random numbers of its signature's shapes) with ``N`` intra-op
threads (TensorFlow's pool, one per process: servex's ``--tensorflow_intra_op_parallelism``) and times its
``serving_default`` signature: the mean and median latency of batch-1 calls back to back, then the rows a second that
one caller, and two callers at once, get from batches of ``--batch`` rows. Thread counts alternate within each round;
figures are medians over rounds.

    python scripts/bench_threads.py --models transformer,mobilenet_v2,resnet50 --threads 1,2 --rounds 2
    python scripts/bench_threads.py --models /models/mine/1 --int_high 30000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.bench_suite import PY, rows  # noqa: E402
from scripts.suite_models import MODELS, export  # noqa: E402

FIELDS = ("latency_mean_ms", "latency_median_ms", "rows_s_1", "rows_s_2")


def child(spec: dict) -> None:
    """In a fresh process: one model at one thread count, printed as one JSON line."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(spec["threads"])
    fn = tf.saved_model.load(spec["path"]).signatures["serving_default"]
    rng, seconds, batch = np.random.default_rng(0), spec["seconds"], spec["batch"]
    one, many = (_feeds(fn, spec, b, rng) for b in (1, batch))
    for _ in range(5):  # the first calls at a shape build its kernels
        fn(**one)
    fn(**many)
    latency: list[float] = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop or len(latency) < 3:
        started = time.perf_counter()
        fn(**one)
        latency.append(time.perf_counter() - started)
    served = {}
    for callers in (1, 2):
        done = [0] * callers
        started = time.perf_counter()
        workers = [threading.Thread(target=_call, args=(fn, many, started + seconds, done, k)) for k in range(callers)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        served[callers] = sum(done) * batch / (time.perf_counter() - started)
    print(json.dumps({"latency_mean_ms": 1000 * statistics.mean(latency),
                      "latency_median_ms": 1000 * statistics.median(latency),
                      "rows_s_1": served[1], "rows_s_2": served[2]}))  # fmt: skip


def _feeds(fn, spec: dict, batch: int, rng) -> dict:
    """``batch`` rows of every input: the suite's own for its models, else random numbers of the signature's shapes."""
    import tensorflow as tf

    if spec["model"] in MODELS:
        return {i.name: tf.constant(rows(i, batch, rng)) for i in MODELS[spec["model"]].inputs}
    feeds = {}
    for name, tensor in fn.structured_input_signature[1].items():
        dims = tensor.shape.as_list()[1:] if tensor.shape.rank else None
        if dims is None or None in dims:
            raise SystemExit(f"input {name!r} has shape {tensor.shape}: give a model whose inputs have fixed sizes")
        dtype = tensor.dtype.as_numpy_dtype
        if tensor.dtype.is_floating:
            feeds[name] = tf.constant(rng.random((batch, *dims)).astype(dtype))
        elif tensor.dtype.is_integer:
            feeds[name] = tf.constant(rng.integers(0, spec["int_high"], (batch, *dims)).astype(dtype))
        else:
            raise SystemExit(f"input {name!r} is {tensor.dtype.name}: only numeric inputs are generated")
    return feeds


def _call(fn, feeds: dict, stop: float, done: list[int], k: int) -> None:
    """One caller: ``fn(**feeds)`` until ``stop``, counted in ``done[k]``."""
    while time.perf_counter() < stop:
        fn(**feeds)
        done[k] += 1


def measure(model: str, path: Path, threads: int, a) -> dict:
    spec = {"model": model, "path": str(path), "threads": threads, "seconds": a.seconds, "batch": a.batch,
            "int_high": a.int_high}  # fmt: skip
    out = subprocess.run([str(PY), __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{model} at {threads} threads: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models",
        default="transformer,mobilenet_v2,resnet50",
        help="the suite's model names, or SavedModel version directories",
    )
    ap.add_argument("--threads", default="1,2", help="intra-op thread counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    ap.add_argument("--batch", type=int, default=16, help="rows of each call in the throughput measurements")
    ap.add_argument(
        "--models_dir",
        default=os.path.join(tempfile.gettempdir(), "suite"),
        help="where the models are (exported there if missing; bench_suite.py's default)",
    )
    ap.add_argument("--int_high", type=int, default=100, help="integer inputs of a given SavedModel: [0, this)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))
    models, counts = a.models.split(","), [int(n) for n in a.threads.split(",")]
    suite = tuple(m for m in models if m in MODELS)
    paths = {m: base / "1" for m, base in export(Path(a.models_dir), suite).items()}
    paths.update({m: Path(m) for m in models if m not in MODELS})
    results: dict[tuple[str, int], list[dict]] = {}
    for n in range(a.rounds):
        for model in models:
            for threads in counts if n % 2 == 0 else counts[::-1]:
                result = measure(model, paths[model], threads, a)
                print(json.dumps({"round": n + 1, "model": model, "threads": threads, **result}), flush=True)
                results.setdefault((model, threads), []).append(result)
    print(f"\n| model | intra-op threads | batch-1 mean ms | batch-1 median ms | rows/s, 1 caller, batches of "
          f"{a.batch} | rows/s, 2 callers |\n| --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for (model, threads), runs in results.items():
        cells = [statistics.median(run[field] for run in runs) for field in FIELDS]
        print(f"| {model} | {threads} | {cells[0]:.2f} | {cells[1]:.2f} | {cells[2]:,.1f} | {cells[3]:,.1f} |")


if __name__ == "__main__":
    main()
