"""Overhead of a cache-hit GraphExecutor run over calling TensorFlow directly, in-process (no gRPC).

    python scripts/bench_graph_executor.py [--iterations 20000] [--workdir /tmp/servex-bench]

On the shared kit's MLP (batch 1 and 32) and tiny (y = 0.5x + 2) models, times per run, in microseconds:
- session.run(fetches, feed_dict): TensorFlow's everyday TF1 call;
- the raw session callable of the pruned graph (what a LoadedClientGraph wraps): the floor;
- GraphExecutor.run: name-order plan lookup, cache hit, dtype/shape checks, the callable, outputs reordered.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from tensorflow.core.protobuf import config_pb2  # noqa: E402

from servex.executor import GraphExecutor  # noqa: E402
from servex.loader import load_saved_model  # noqa: E402


def per_call_us(fn, iterations: int) -> float:
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servex-bench"))
    a = ap.parse_args()
    kit = REPO.parent / "shared" / "bench" / "make_models.py"
    subprocess.run([sys.executable, str(kit), a.workdir, "mlp", "tiny"], check=True, capture_output=True)
    print("| model | batch | session.run | raw callable | GraphExecutor.run (cache hit) | overhead over callable |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model, alias, width in [("mlp", "features", 64), ("tiny", "x", 1)]:
        loaded = load_saved_model(os.path.join(a.workdir, model, "1"))
        sig = loaded.signatures["serving_default"]
        feed, fetch = sig.inputs[alias].name, sig.outputs[sig.output_aliases[0]].name
        executor = GraphExecutor(loaded)
        options = config_pb2.CallableOptions(feed=[feed], fetch=[fetch])
        options.run_options.inter_op_thread_pool = -1
        raw = loaded.session._make_callable_from_options(options)
        for batch in (1, 32):
            x = np.random.default_rng(0).random((batch, width), dtype=np.float32)
            inputs = {feed: x}
            np.testing.assert_array_equal(executor.run(inputs, [fetch])[0], raw(x)[0])
            t_session = per_call_us(lambda: loaded.session.run(fetch, {feed: x}), a.iterations // 4)  # noqa: B023
            t_raw = per_call_us(lambda: raw(x), a.iterations)  # noqa: B023
            t_exec = per_call_us(lambda: executor.run(inputs, [fetch]), a.iterations)  # noqa: B023
            print(f"| {model} | {batch} | {t_session:.1f} | {t_raw:.1f} | {t_exec:.1f} | {t_exec - t_raw:+.1f} |")


if __name__ == "__main__":
    main()
