"""Cold start and memory: lazy restoration against eager, on the shared kit's `embed` model.

    python scripts/bench_lazy_restore.py [--workdir /tmp/servex-bench] [--runs 3] [--cold_disk]

`embed` holds a 2,000,000 x 64 float32 table (512 MB) read by serving_default and a scalar read by calibrate.
For each server it measures, from process start, the time to the first answer of calibrate (tiny: of its own
serving_default) and the process's peak RSS (VmHWM) at that moment; then, for embed, the time to the first
serving_default answer and that signature's latency once restored. Results are the median of --runs starts;
the increments are over the same server serving `tiny` (TensorFlow's own start-up and memory).

A fourth server serves a copy of embed (hard links) whose version holds a warm-up record, one serving_default
Predict (`assets.extra/tf_serving_warmup_requests`): its table is read before the version serves, so its first
calibrate answer comes later and its first serving_default answer comes at once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.framework import tensor_pb2, types_pb2  # noqa: E402
from tensorflow_serving.apis import predict_pb2, prediction_log_pb2, prediction_service_pb2_grpc  # noqa: E402

from tests.support.daemon import free_port  # noqa: E402


def request(model: str, signature: str, alias: str, value: np.ndarray, dtype: int) -> predict_pb2.PredictRequest:
    req = predict_pb2.PredictRequest()
    req.model_spec.name = model
    req.model_spec.signature_name = signature
    proto = tensor_pb2.TensorProto(dtype=dtype, tensor_content=value.tobytes())
    for d in value.shape:
        proto.tensor_shape.dim.add(size=d)
    req.inputs[alias].CopyFrom(proto)
    return req


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def first_answer(stub, req, start: float, proc, timeout: float = 300) -> float:
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"servex exited with {proc.returncode}")
        try:
            stub.Predict(req, timeout=60)
            return time.monotonic() - start
        except grpc.RpcError:
            time.sleep(0.01)
    raise RuntimeError("no answer")


def with_warmup(embed: Path, out: Path, req: predict_pb2.PredictRequest) -> Path:
    """A copy of embed (hard links) whose version replays ``req`` at load."""
    if not out.exists():
        shutil.copytree(embed, out, copy_function=os.link)
        extra = out / "1" / "assets.extra"
        extra.mkdir()
        record = prediction_log_pb2.PredictionLog()
        record.predict_log.request.CopyFrom(req)
        with tf.io.TFRecordWriter(str(extra / "tf_serving_warmup_requests")) as writer:
            writer.write(record.SerializeToString())
    return out


def drop_model_files_from_page_cache() -> None:
    """Cold model files, warm TensorFlow: drop the page cache (root only), then import TensorFlow once so that
    only the model's own files are read from disk by the measured start."""
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    subprocess.run([sys.executable, "-c", "import server.app"], cwd=REPO, check=True, capture_output=True)


def measure(base: Path, model: str, flags: list[str], cold_req, hot_req=None, cold_disk: bool = False) -> dict:
    if cold_disk:
        drop_model_files_from_page_cache()
    port = free_port()
    cmd = [sys.executable, "-m", "servex.server", f"--port={port}", "--metrics_port=0", "--rest_api_port=0",
           "--bind_address=127.0.0.1", f"--model_base_path={base}", f"--model_name={model}", *flags]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Retry the connection every few ms while the server starts (gRPC's default back-off waits seconds).
    fast_retry = [("grpc.initial_reconnect_backoff_ms", 5), ("grpc.min_reconnect_backoff_ms", 5),
                  ("grpc.max_reconnect_backoff_ms", 20)]  # fmt: skip
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=fast_retry)
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
    try:
        out = {"first_s": first_answer(stub, cold_req, start, proc), "peak_mb": peak_rss_mb(proc.pid)}
        if hot_req is not None:
            t0 = time.monotonic()
            stub.Predict(hot_req, timeout=300)
            out["serving_first_s"] = time.monotonic() - t0
            out["serving_peak_mb"] = peak_rss_mb(proc.pid)
            latencies = []
            for _ in range(200):
                t1 = time.perf_counter()
                stub.Predict(hot_req, timeout=30)
                latencies.append((time.perf_counter() - t1) * 1000)
            out["serving_p50_ms"] = statistics.median(latencies)
        return out
    finally:
        channel.close()
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servex-bench"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cold_disk", action="store_true", help="drop the page cache before each start (root only)")
    a = ap.parse_args()
    work = Path(a.workdir)
    kit = REPO.parent / "shared" / "bench" / "make_models.py"
    subprocess.run([sys.executable, str(kit), str(work), "tiny", "embed"], check=True, capture_output=True)
    x = np.array([[1.0]], np.float32)
    calibrate = request("embed", "calibrate", "x", x, types_pb2.DT_FLOAT)
    serving = request("embed", "serving_default", "ids", np.arange(8, dtype=np.int64).reshape(1, 8), types_pb2.DT_INT64)
    tiny = request("tiny", "serving_default", "x", x, types_pb2.DT_FLOAT)

    warm = with_warmup(work / "embed", work / "embed_warmup", serving)
    cold = a.cold_disk
    rounds = []  # interleaved, so that drift in the machine's speed hits all four alike
    for _ in range(a.runs):
        rounds.append(
            (
                measure(work / "tiny", "tiny", [], tiny, cold_disk=cold),
                measure(work / "embed", "embed", [], calibrate, serving, cold_disk=cold),
                measure(work / "embed", "embed", ["--lazy_restore=false"], calibrate, serving, cold_disk=cold),
                measure(warm, "embed", [], calibrate, serving, cold_disk=cold),
            )
        )

    def median(i: int) -> dict:
        return {k: statistics.median(r[i][k] for r in rounds) for k in rounds[0][i]}

    base, lazy, eager, warmed = median(0), median(1), median(2), median(3)
    print("| server | first calibrate answer (s) | increment over tiny (s) | peak RSS (MB) | increment (MB) |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| tiny (baseline) | {base['first_s']:.2f} | | {base['peak_mb']:.0f} | |")
    rows = [("embed, lazy", lazy), ("embed, eager (--lazy_restore=false)", eager), ("embed, lazy, warm-up", warmed)]
    for label, r in rows:
        print(f"| {label} | {r['first_s']:.2f} | {r['first_s'] - base['first_s']:.2f} | {r['peak_mb']:.0f} | "
              f"{r['peak_mb'] - base['peak_mb']:.0f} |")  # fmt: skip
    dt_lazy, dt_eager = lazy["first_s"] - base["first_s"], eager["first_s"] - base["first_s"]
    dm_lazy, dm_eager = lazy["peak_mb"] - base["peak_mb"], eager["peak_mb"] - base["peak_mb"]
    print(f"\nlazy/eager increment: time {dt_lazy / dt_eager:.3f}x, peak memory {dm_lazy / dm_eager:.3f}x")
    print(f"lazy: first serving_default answer {lazy['serving_first_s']:.2f} s after calibrate answered "
          f"(restores the table; peak RSS then {lazy['serving_peak_mb']:.0f} MB); p50 once restored "
          f"{lazy['serving_p50_ms']:.2f} ms (eager: {eager['serving_p50_ms']:.2f} ms, peak RSS after its first "
          f"serving_default answer {eager['serving_peak_mb']:.0f} MB)")  # fmt: skip
    print(f"lazy with a warm-up record: first serving_default answer {warmed['serving_first_s'] * 1000:.1f} ms after "
          f"calibrate answered (lazy without: {lazy['serving_first_s'] * 1000:.0f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
