"""Where one suite model's load goes in servex: rows/s, batches, run times, and the cores each thread kept busy.

    python scripts/bench_load.py gru [--concurrency 1,8,32,4x8] [--seconds 8] [--models_dir /tmp/suite]
        [--servex_flag=--X]

Starts servex (default flags, plus any ``--servex_flag``) on ``MODELS_DIR/MODEL`` (scripts/suite_models.py exports
it), drives KServe v2 ModelInfer through the kit's h2load driver at each level, one after another (``C``: C callers,
one row a request; ``CxR``: C callers, R rows a request), and prints per level: rows/s, calls/s and mean latency
(h2load's), the mean batch a request ran in and the mean run time of its batch (``servex_batch_size``,
``servex_run_seconds``: both observed once per request), the cores the whole machine kept busy (``/proc/stat``), the
busiest servex threads' cores and the time they waited, runnable, for a core (``/proc/PID/task``: the event loop,
the run workers, TensorFlow's threads; unnamed), and h2load's. Used for docs/performance.md's GRU paragraph.
"""

from __future__ import annotations

import argparse
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.bench_peers import METHOD, free_port, h2load_run  # noqa: E402  (h2grpc's)
from scripts.bench_suite import PY, infer_request, stop, wait_ready  # noqa: E402
from scripts.suite_models import MODELS, export  # noqa: E402

SUMS = ("servex_batch_size_sum", "servex_batch_size_count", "servex_run_seconds_sum", "servex_run_seconds_count")


def scrape(port: int) -> dict[str, float]:
    """The per-request batch-size and run-time sums and counts, over every label set."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {n: sum(float(m.group(1)) for m in re.finditer(rf"^{n}{{[^}}]*}} (\S+)", text, re.M)) for n in SUMS}


def thread_seconds(pid: int) -> dict[str, tuple[float, float]]:
    """Seconds each thread of ``pid`` ran on a core and waited, runnable, for one so far (its schedstat)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ran, waited = (task / "schedstat").read_text().split()[:2]
        except OSError:  # the thread ended
            continue
        out[task.name] = (int(ran) / 1e9, int(waited) / 1e9)
    return out


def machine() -> list[int]:
    return [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]


def level(port: int, metrics_port: int, pid: int, frame: Path, c: int, per_call: int, seconds: int) -> str:
    m0, t0, s0, k0, w0 = scrape(metrics_port), thread_seconds(pid), machine(), os.times(), time.monotonic()
    r = h2load_run(port, str(frame), c, seconds, METHOD)
    m1, t1, s1, k1 = scrape(metrics_port), thread_seconds(pid), machine(), os.times()
    wall = time.monotonic() - w0
    d = {n: m1[n] - m0[n] for n in SUMS}
    ticks = [b - a for a, b in zip(s0, s1, strict=True)]
    busy = len(os.sched_getaffinity(0)) * (1 - (ticks[3] + ticks[4]) / max(sum(ticks), 1))  # idle + iowait
    before = lambda k: t0.get(k, (0.0, 0.0))  # noqa: E731
    threads = sorted(((t1[k][0] - before(k)[0]) / wall, (t1[k][1] - before(k)[1]) / wall) for k in t1)[::-1][:4]
    client = (k1.children_user + k1.children_system - k0.children_user - k0.children_system) / wall
    batch = d["servex_batch_size_sum"] / max(d["servex_batch_size_count"], 1)
    run_ms = 1000 * d["servex_run_seconds_sum"] / max(d["servex_run_seconds_count"], 1)
    shown = ", ".join(f"{ran:.2f} (waited {waited:.2f})" for ran, waited in threads)
    return (
        f"{c} callers x {per_call} rows: {r['rps'] * per_call:,.0f} rows/s, {r['rps']:,.0f} calls/s, mean "
        f"{r['mean_ms']:.2f} ms; a request's batch {batch:.1f} rows, its run {run_ms:.2f} ms; machine {busy:.2f} "
        f"cores busy, servex's busiest threads {shown}, h2load {client:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--models_dir", default="/tmp/suite")
    ap.add_argument("--servex_flag", action="append", default=[], help="an extra servex flag (repeatable)")
    a = ap.parse_args()
    base = Path(a.models_dir) / a.model
    export(Path(a.models_dir), [a.model])
    port, metrics_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "servex.log", "w")  # noqa: SIM115  (closed with the directory)
        proc = subprocess.Popen(
            [str(PY), "-m", "servex.server", f"--model_name={a.model}", f"--model_base_path={base}", f"--port={port}",
             "--rest_api_port=0", f"--metrics_port={metrics_port}", "--bind_address=127.0.0.1", *a.servex_flag],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            wait_ready(port, proc, a.model)
            for c, per_call in (map(int, (x + "x1").split("x")[:2]) for x in a.concurrency.split(",")):
                payload = infer_request(a.model, per_call).SerializeToString()
                frame = Path(tmp) / f"request-{per_call}.grpc"
                frame.write_bytes(b"\0" + struct.pack(">I", len(payload)) + payload)  # a gRPC message frame
                print(level(port, metrics_port, proc.pid, frame, c, per_call, a.seconds), flush=True)
        finally:
            stop(proc)
            log.close()
            print("servex's choices:", *(line.split(": ", 1)[-1].strip() for line in open(log.name)
                                         if "client graph" in line), sep="\n  ")  # fmt: skip


if __name__ == "__main__":
    main()
