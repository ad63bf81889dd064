"""servex against its peers, side by side in one run: KServe v2 gRPC ModelInfer, batch-1 requests on the MLP.

    python scripts/bench_peers.py [--seconds 8] [--concurrency 1,8,32] [--peers_dir /tmp/servex-peers] [--rounds 1]
                                  [--only servex,servex_batching,servex_pinned,servex_1listener,servex_2proc,kserve,
                                          mlserver,echo]

Uses the shared kit in ../shared/bench only (never copied): make_models.py exports the MLP, peers/setup.sh must
have built the peer venvs (KServe's Python ModelServer, MLServer with adaptive batching 32 / 2 ms), echo_floor.py
is the do-nothing Python gRPC floor. Every server gets the same SavedModel and the same closed-loop loopback load:
h2load (h2grpc.py) at each concurrency for throughput and mean latency, then the kit's Python driver (loadgen.py)
at the highest concurrency for p99 and to count errors (h2load counts HTTP-level success only); h2load's own
per-request log gives a second p99 there, from a client that takes little CPU from the server. Servers run one
at a time. Prints one JSON line per measurement, then a markdown table. With ``--rounds R`` the whole list runs R
times, servers alternating, and the table gives each figure's median over the rounds (the req/s of each round at
the highest concurrency follow it): on a small shared machine one run can be 15% off either way. Each servex row is
then set against the better peer (KServe or MLServer) of the same round, round by round, with the median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT = REPO.parent / "shared" / "bench"
sys.path.insert(0, str(KIT))

import grpc  # noqa: E402
from h2grpc import run as h2load_run  # noqa: E402  (the kit's drivers)
from loadgen import build  # noqa: E402
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

METHOD = "/inference.GRPCInferenceService/ModelInfer"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servers(work: Path, peers: Path) -> dict[str, callable]:
    """name -> (grpc_port -> command line)."""
    model = work / "mlp"
    servex = [sys.executable, "-m", "servex.server", "--model_name=mlp", f"--model_base_path={model}",
              "--rest_api_port=0", "--metrics_port=0", "--bind_address=127.0.0.1"]  # fmt: skip
    return {
        "servex": lambda port: [*servex, f"--port={port}"],
        "servex_batching": lambda port: [*servex, f"--port={port}", "--enable_batching"],
        "servex_pinned": lambda port: [*servex, f"--port={port}", "--enable_batching", "--event_loop_cpu=0"],
        "servex_1listener": lambda port: [*servex, f"--port={port}", "--enable_batching", "--grpc_listeners=1"],
        "servex_2proc": lambda port: [*servex, f"--port={port}", "--enable_batching", "--serving_processes=2"],
        "kserve": lambda port: [
            str(peers / "kserve" / "bin" / "python"),
            str(KIT / "peers" / "kserve_tf.py"),
            "mlp",
            str(model / "1"),
            str(port),
            str(free_port()),
        ],  # fmt: skip
        "mlserver": lambda port: [
            "bash",
            str(KIT / "peers" / "run_mlserver.sh"),
            "mlp",
            str(model / "1"),
            str(port),
            str(free_port()),
            "32",
            "0.002",
        ],  # fmt: skip
        "echo": lambda port: [sys.executable, str(KIT / "echo_floor.py"), str(port), "aio"],
    }


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Until a real ModelInfer answers (the echo floor answers anything)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest.FromString(build("mlp", "features", [1, 64], "FP32"))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                stub.ModelInfer(request, timeout=5)
                return
            except grpc.RpcError:
                time.sleep(0.5)
        raise RuntimeError(f"no answer on port {port} within {timeout}s")
    finally:
        channel.close()


def h2load_percentiles(port: int, frame: Path, concurrency: int, seconds: int, method: str = METHOD) -> dict:
    """p50/p99 latency at ``concurrency`` from h2load's per-request log, with the kit driver's connection layout
    (at most 4 connections, the callers spread over them as streams): a C client, so the server is measured."""
    connections = min(concurrency, 4)
    with tempfile.NamedTemporaryFile(suffix=".tsv") as log:
        subprocess.run(
            ["h2load", f"http://127.0.0.1:{port}{method}", "-d", str(frame), "-c", str(connections),
             "-m", str(max(1, concurrency // connections)), "-D", str(seconds), "--warm-up-time=1",
             "-H", "content-type: application/grpc", "-H", "te: trailers", f"--log-file={log.name}"],
            capture_output=True, check=True,
        )  # fmt: skip
        micros = sorted(int(line.split("\t")[2]) for line in Path(log.name).read_text().splitlines() if line)
    pick = lambda q: round(micros[min(len(micros) - 1, int(q * len(micros)))] / 1000, 2)  # noqa: E731
    return {"concurrency": concurrency, "requests": len(micros), "p50_ms": pick(0.5), "p99_ms": pick(0.99)}


def loadgen(port: int, concurrency: int, seconds: float) -> dict:
    out = subprocess.run(
        [sys.executable, str(KIT / "loadgen.py"), "--port", str(port), "--model", "mlp", "--input", "features",
         "--shape", "1,64", "--concurrency", str(concurrency), "--seconds", str(seconds)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--peers_dir", default=os.environ.get("PEERS_DIR", "/tmp/servex-peers"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--only", default="servex,servex_batching,servex_pinned,servex_1listener,servex_2proc,kserve,mlserver,echo"
    )
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servex-bench"))
    a = ap.parse_args()
    if shutil.which("h2load") is None:
        sys.exit("h2load is missing: apt-get install nghttp2-client")
    work = Path(a.workdir)
    subprocess.run([sys.executable, str(KIT / "make_models.py"), str(work), "mlp"], check=True, capture_output=True)
    payload = build("mlp", "features", [1, 64], "FP32")
    frame = work / "infer.grpc"
    frame.write_bytes(b"\0" + struct.pack(">I", len(payload)) + payload)
    levels = [int(c) for c in a.concurrency.split(",")]
    commands = servers(work, Path(a.peers_dir))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PEERS_DIR=a.peers_dir)
    rows: dict[str, list] = {}
    for name in [name for _ in range(a.rounds) for name in a.only.split(",")]:
        port = free_port()
        log = open(work / f"{name}.log", "wb")
        proc = subprocess.Popen(commands[name](port), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            wait_ready(port, proc)
            processes = 2 if name == "servex_2proc" else 1 if name.startswith("servex") else 0
            while (work / f"{name}.log").read_bytes().count(b"servex ready") < processes:
                time.sleep(0.5)  # every serving process has bound the port
            row = {}
            for c in levels:
                r = h2load_run(port, str(frame), c, a.seconds, METHOD)
                r["server"] = name
                print(json.dumps(r), flush=True)
                row[c] = r
            tail = h2load_percentiles(port, frame, levels[-1], a.seconds)
            tail["server"] = name
            print(json.dumps(tail), flush=True)
            check = loadgen(port, levels[-1], a.seconds)
            check["server"] = name
            print(json.dumps(check), flush=True)
            rows.setdefault(name, []).append((row, tail, check))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
    top = levels[-1]
    print()
    print("| server | " + " | ".join(f"c={c} req/s | c={c} mean ms" for c in levels)
          + f" | c={top} p99 ms (h2load) | c={top} p99 ms (Python client) | errors |")  # fmt: skip
    print("| --- " * (2 * len(levels) + 4) + "|")
    for name, runs in rows.items():
        rps = {c: statistics.median(row[c]["rps"] for row, _, _ in runs) for c in levels}
        mean = {c: statistics.median(row[c]["mean_ms"] for row, _, _ in runs) for c in levels}
        cells = " | ".join(f"{rps[c]:,.0f} | {mean[c]:.2f}" for c in levels)
        p99_h2load = statistics.median(tail["p99_ms"] for _, tail, _ in runs)
        p99_python = statistics.median(check["p99_ms"] for _, _, check in runs)
        errors = sum(check["errors"] + (row[top]["failed"] or 0) for row, _, check in runs)
        print(f"| {name} | {cells} | {p99_h2load:.1f} | {p99_python:.1f} | {errors} |")
    if a.rounds > 1:
        print()
        for name, runs in rows.items():
            print(f"{name}: c={top} req/s by round: " + ", ".join(f"{row[top]['rps']:,.0f}" for row, _, _ in runs))
        print_ratios(rows, top)


def print_ratios(rows: dict[str, list], top: int) -> None:
    """Each servex row against the better peer of the same round at ``top`` callers, round by round: a round
    runs every server within minutes, so the ratio is steadier than the req/s when the machine's speed drifts."""
    peers = [name for name in rows if name in ("kserve", "mlserver")]
    if not peers:
        return
    rounds = min(len(rows[name]) for name in peers)
    better = [max(rows[name][i][0][top]["rps"] for name in peers) for i in range(rounds)]
    print()
    for name, runs in rows.items():
        if not name.startswith("servex"):
            continue
        ratios = [row[top]["rps"] / peer for (row, _, _), peer in zip(runs, better, strict=False)]
        print(f"{name}: c={top} against the better peer by round: " + ", ".join(f"{r:.2f}x" for r in ratios)
              + f"; median {statistics.median(ratios):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
