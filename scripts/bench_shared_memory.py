"""Large inputs sent in the request against read from system shared memory (Triton's extension), one caller.

    python scripts/bench_shared_memory.py [--sizes 65536,1048576,16777216,67108864] [--calls 30]

Exports a model that sums a float32 input of any length (x [None, None] -> total), starts servex on it on
loopback, and times tritonclient.grpc ModelInfer calls with x of each size in bytes: sent as raw_input_contents,
then read from a registered shared memory region (tritonclient.utils.shared_memory, /dev/shm) that the client
filled once. Prints one JSON line per size and mode (median and p90 ms per call), then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tritonclient.grpc as triton  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402

from tests.support.daemon import Daemon  # noqa: E402


def export_total(path: Path) -> None:
    class Total(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32, name="x")])
        def serve(self, x):
            return {"total": tf.reduce_sum(x)}

    module = Total()
    tf.saved_model.save(module, str(path / "1"), signatures={"serving_default": module.serve})


def timed(call, calls: int) -> dict:
    call()  # warm: the client graph is built once
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return {"median_ms": round(statistics.median(times), 3), "p90_ms": round(times[int(0.9 * len(times))], 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="65536,1048576,16777216,67108864")
    ap.add_argument("--calls", type=int, default=30)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="servex-shm-bench-"))
    export_total(work / "total")
    daemon = Daemon([f"--model_base_path={work / 'total'}", "--model_name=total"], work).wait_serving()
    client = triton.InferenceServerClient(daemon.address)
    rows = []
    try:
        for size in (int(s) for s in a.sizes.split(",")):
            x = np.ones((1, size // 4), np.float32)
            sent = triton.InferInput("x", list(x.shape), "FP32")
            sent.set_data_from_numpy(x)
            handle = shm.create_shared_memory_region("bench", f"/servex-bench-{os.getpid()}", x.nbytes)
            try:
                shm.set_shared_memory_region(handle, [x])
                client.register_system_shared_memory("bench", f"/servex-bench-{os.getpid()}", x.nbytes)
                mapped = triton.InferInput("x", list(x.shape), "FP32")
                mapped.set_shared_memory("bench", x.nbytes)
                row = {"bytes": size}
                for mode, tensor in (("request", sent), ("shared_memory", mapped)):
                    answer = client.infer("total", [tensor])
                    assert float(answer.as_numpy("total")) == x.size, mode
                    row[mode] = timed(lambda t=tensor: client.infer("total", [t]), a.calls)
                    print(json.dumps({"bytes": size, "mode": mode, **row[mode]}), flush=True)
                rows.append(row)
            finally:
                client.unregister_system_shared_memory("bench")
                shm.destroy_shared_memory_region(handle)
    finally:
        client.close()
        daemon.stop()
    print()
    print("| input | in the request: median ms | p90 ms | shared memory: median ms | p90 ms | speed-up (median) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        r, s = row["request"], row["shared_memory"]
        ratio = r["median_ms"] / s["median_ms"]
        print(f"| {row['bytes']:,} B | {r['median_ms']} | {r['p90_ms']} | {s['median_ms']} | {s['p90_ms']} | "
              f"{ratio:.1f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
