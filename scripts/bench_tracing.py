"""What tracing costs: one servex, its tracing switched off and on (sampling 1%) in alternate blocks of load.

    python scripts/bench_tracing.py [--blocks 12] [--seconds 6] [--concurrency 32] [--rate 100] [--mode triton]

servex serves the kit's MLP (KServe v2 ``ModelInfer``, batch 1: the gRPC call is the whole cost, so an overhead
shows at its largest), with OpenTelemetry tracing configured to send its spans over OTLP/gRPC to a collector's
receiver in this process (tests/support/otlp.py). Between blocks, Triton's trace API (tritonclient's
``update_trace_settings``) sets ``trace_level`` to OFF or TIMESTAMPS, in the order A B B A, so that the same process
serves both conditions and the machine's drift reaches both alike (two servers started alike differ here by 5-10%).
Per block: requests/s (h2load), and the server's CPU seconds per 1,000 requests (its user and system time, from
/proc), which drifts less than requests/s on a shared machine. Prints one JSON line per block, then the medians of
the per-pair ratios (traced / off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import tritonclient.grpc as triton  # noqa: E402
from bench_peers import KIT, METHOD, free_port, wait_ready  # noqa: E402
from h2grpc import run as h2load_run  # noqa: E402  (the kit's driver)
from loadgen import build  # noqa: E402

from tests.support.otlp import receiver  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` and its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=12, help="blocks of each condition (A B B A ...)")
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rate", type=int, default=100, help="trace_rate: one request in this many is traced")
    ap.add_argument("--mode", default="opentelemetry", choices=("opentelemetry", "triton"),
                    help="where the spans go: OTLP/gRPC to a receiver here, or Triton's JSON trace file")  # fmt: skip
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servex-bench-tracing"))
    a = ap.parse_args()
    work = Path(a.workdir)
    subprocess.run([sys.executable, str(KIT / "make_models.py"), str(work), "mlp"], check=True, capture_output=True)
    payload = build("mlp", "features", [1, 64], "FP32")
    frame = work / "infer.grpc"
    frame.write_bytes(b"\0" + struct.pack(">I", len(payload)) + payload)
    port = free_port()
    with receiver() as (collector, otlp_port), open(work / "servex.log", "wb") as log:
        command = [sys.executable, "-m", "servex.server", "--model_name=mlp", f"--model_base_path={work / 'mlp'}",
                   "--rest_api_port=0", "--metrics_port=0", "--bind_address=127.0.0.1", f"--port={port}",
                   "--trace_config=level=OFF", f"--trace_config=rate={a.rate}"]  # fmt: skip
        if a.mode == "opentelemetry":
            command += ["--trace_config=mode=opentelemetry", f"--trace_config=opentelemetry,url=127.0.0.1:{otlp_port}"]
        else:
            command += ["--trace_config=mode=triton", f"--trace_config=triton,file={work / 'trace.json'}"]
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))  # fmt: skip
        client = triton.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            wait_ready(port, proc)
            h2load_run(port, str(frame), a.concurrency, 2, METHOD)  # warm
            results: dict[str, list[dict]] = {"off": [], "traced": []}
            order = [n for i in range(a.blocks) for n in (("off", "traced") if i % 2 == 0 else ("traced", "off"))]
            for name in order:
                level = "TIMESTAMPS" if name == "traced" else "OFF"
                client.update_trace_settings(settings={"trace_level": [level]})
                before = cpu_seconds(proc.pid)
                r = h2load_run(port, str(frame), a.concurrency, a.seconds, METHOD)
                cpu = cpu_seconds(proc.pid) - before
                requests = r["rps"] * (a.seconds + 1)  # h2load's warm-up second is served too
                row = {"tracing": name, "rps": r["rps"], "failed": r["failed"],
                       "cpu_ms_per_1000": round(cpu / requests * 1e6, 1)}  # fmt: skip
                results[name].append(row)
                print(json.dumps(row), flush=True)
        finally:
            client.close()
            proc.terminate()
            proc.wait(30)
        pairs = list(zip(results["traced"], results["off"], strict=True))
        summary = {
            "rate": a.rate,
            "blocks": a.blocks,
            "rps_ratio_median": round(statistics.median(t["rps"] / o["rps"] for t, o in pairs), 3),
            "cpu_per_request_ratio_median": round(
                statistics.median(t["cpu_ms_per_1000"] / o["cpu_ms_per_1000"] for t, o in pairs), 3
            ),
            "spans_received": len(collector.spans),
        }
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
