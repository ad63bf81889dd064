"""One caller's requests over servex's first seconds on a suite model: where the first requests' time goes.

    python scripts/bench_first_seconds.py mobilenet_v2 [--seconds 6] [--starts 3] [--models_dir /tmp/suite]
        [--servex_flag=--X]

Starts servex (default flags, plus any ``--servex_flag``) on ``MODELS_DIR/MODEL`` (scripts/suite_models.py exports
it) ``--starts`` times; each time sends three KServe v2 ModelInfer calls (as scripts/bench_suite.py does before its
levels), then one call after another through grpcio's client for ``--seconds``, and prints the mean and p50 from the
first second on, the requests that took over ``--slow_ms`` (when, how long), and servex's log lines of its choices
(thread modes, sessions made). Used for docs/performance.md's "The first seconds".
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import grpc
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tritonclient.grpc import service_pb2_grpc  # noqa: E402

from scripts.bench_peers import free_port  # noqa: E402
from scripts.bench_suite import command, infer_request, stop, wait_ready  # noqa: E402
from scripts.suite_models import export  # noqa: E402

CHOICES = ("servex.executor.thread_modes", "servex.loader.one_thread", "servex.executor.xla_programs")


def one_start(model: str, base: Path, a, log_path: Path) -> None:
    port = free_port()
    flags = types.SimpleNamespace(servex_flag=a.servex_flag, peers_dir="")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command("servex", model, base, port, flags), cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            wait_ready(port, proc, model)
            request = infer_request(model)
            options = [("grpc.max_receive_message_length", 1 << 30)]
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
                stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
                for _ in range(3):
                    stub.ModelInfer(request, timeout=120)
                times, start = [], time.perf_counter()
                while (t := time.perf_counter()) - start < a.seconds:
                    stub.ModelInfer(request, timeout=120)
                    times.append((t - start, (time.perf_counter() - t) * 1000))
        finally:
            stop(proc)
    at, ms = np.array(times).T
    counted = ms[at >= 1]
    slow = ", ".join(f"{ms:.0f} ms at {at:.2f} s" for at, ms in times if ms > a.slow_ms) or "none"
    print(f"{len(ms)} calls; from 1 s on: mean {counted.mean():.1f} ms, p50 {np.median(counted):.1f} ms; "
          f"over {a.slow_ms:.0f} ms: {slow}")  # fmt: skip
    for line in log_path.read_text(errors="replace").splitlines():
        if any(name in line for name in CHOICES):
            print("   ", line.split(" INFO ", 1)[-1][:220])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--slow_ms", type=float, default=80.0)
    ap.add_argument("--models_dir", default=str(Path(tempfile.gettempdir()) / "suite"))
    ap.add_argument("--servex_flag", action="append", default=[], help="an extra servex flag (repeatable)")
    a = ap.parse_args()
    base = export(Path(a.models_dir), [a.model])[a.model]
    work = Path(tempfile.mkdtemp(prefix="bench-first-seconds-"))
    for n in range(1, a.starts + 1):
        print(f"start {n}:", end=" ", flush=True)
        one_start(a.model, base, a, work / f"servex-{n}.log")


if __name__ == "__main__":
    main()
