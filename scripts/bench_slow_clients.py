"""Slow clients starve no one: other callers' latency with and without 50 REST clients trickling their bodies and
50 gRPC clients that never read their answers.

    python scripts/bench_slow_clients.py [--blocks 6] [--seconds 6] [--callers 4] [--workdir /tmp/servex-bench]
                                         [--servex_flag=--enable_batching]

servex serves the kit's MLP (../shared/bench/make_models.py) as ``mlp`` and TensorFlow Serving's half_plus_two as
``hp``. ``--callers`` threads call Predict on the MLP (batch 1, real tensorflow-serving-api stubs), one call at a
time each, throughout. The blocks alternate (ABBA, so drift over the run falls on both) between no slow clients
and, from a second process so the callers' own process is not disturbed:

- 50 REST clients that send a v1 predict's headers and then its body a byte a second (opened again when servex
  drops them at --rest_api_body_timeout_in_ms);
- 50 gRPC connections (tests/support/h2_client.py), each a Predict on ``hp`` whose 1 MB answer (one value
  broadcast over 250,000 rows) they never let through: a 1 KiB HTTP/2 window, never widened. They answer the
  server's pings, the worst case (a client that stops answering them is dropped within 80 s, see
  server/transport/listeners.py), and are opened again if closed.

Calls are timed only once every slow client is in place (the never-readers have what their windows allow). Prints
the callers' p50/p99 per block and pooled per condition, servex's RSS, and the ratio of the pooled p99s (goal: at
most 1.5x) as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT = REPO.parent / "shared" / "bench"
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SLOW = 50
ROWS = 250_000
WINDOW = 1024
BODY_BYTES = 100_000  # the tricklers' announced Content-Length: never all sent
PREDICT = "/tensorflow.serving.PredictionService/Predict"


def slow_clients(grpc_address: str, rest_port: int, request_file: str) -> None:
    """The second process: keep ``SLOW`` tricklers and ``SLOW`` never-readers (each sending the serialized
    PredictRequest in ``request_file``) open until killed."""
    from tests.support.h2_client import PING, NeverReader

    big = Path(request_file).read_bytes()
    head = (f"POST /v1/models/hp:predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {BODY_BYTES}\r\n\r\n").encode()  # fmt: skip

    def trickler() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", rest_port), timeout=10)
        sock.sendall(head)
        sock.setblocking(False)
        return sock

    readers = [NeverReader(grpc_address, PREDICT, big, window=WINDOW) for _ in range(SLOW)]
    tricklers = [trickler() for _ in range(SLOW)]
    ready, next_byte = False, time.monotonic()
    while True:  # asleep in select but for what comes in and a byte a second
        socks = {r.sock: r for r in readers}
        readable, _, _ = select.select([*socks, *tricklers], [], [], max(0.0, next_byte - time.monotonic()))
        for sock in readable:
            if sock in socks:  # a never-reader: its frames read (the server's pings answered), no window granted
                r = socks[sock]
                r.frames(0.001, answer_pings=True)
                r.seen = [f for f in r.seen if f[0] != PING][-16:]
                if r.closed:
                    r.close()
                    readers[readers.index(r)] = NeverReader(grpc_address, PREDICT, big, window=WINDOW)
                continue
            try:  # a trickler: servex's 408, then its close; trickle again on a new connection
                gone = not sock.recv(65536)
            except (BlockingIOError, ConnectionError):
                gone = True
            if gone:
                sock.close()
                tricklers[tricklers.index(sock)] = trickler()
        if not ready and all(r.data_bytes() >= WINDOW for r in readers):
            ready = True
            print("ready", flush=True)
        if time.monotonic() >= next_byte:
            next_byte += 1.0
            for sock in tricklers:
                try:
                    sock.send(b" ")
                except OSError:
                    pass  # closed by servex: replaced once its close is read


def _cpu_s(pid: int) -> float:
    """The CPU time (user + system) ``pid`` has taken, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return round(next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024, 1)


class Callers:
    """Threads calling Predict on the MLP, one call at a time each; ``take()`` returns the latencies (ms) since
    the last take."""

    def __init__(self, stub, request, count: int):
        self.stub, self.request = stub, request
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            self.stub.Predict(self.request, timeout=30)
            self.latencies.append((time.perf_counter() - t0) * 1000)

    def take(self) -> list[float]:
        out, self.latencies = self.latencies, []
        return out

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def summary(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=100)
    return {"calls": len(values), "p50_ms": round(q[49], 3), "p99_ms": round(q[98], 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=6, help="blocks per condition")
    ap.add_argument("--seconds", type=float, default=6, help="each block's length")
    ap.add_argument("--callers", type=int, default=4)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servex-bench"))
    ap.add_argument("--servex_flag", action="append", default=[])
    ap.add_argument("--slow_clients", nargs=3, help=argparse.SUPPRESS)  # GRPC_ADDRESS REST_PORT REQUEST_FILE
    a = ap.parse_args()
    if a.slow_clients:
        return slow_clients(a.slow_clients[0], int(a.slow_clients[1]), a.slow_clients[2])

    import numpy as np
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    from tests.support.daemon import Daemon, model_config_file
    from tests.support.paths import HALF_PLUS_TWO_TF1

    work = Path(a.workdir)
    subprocess.run([sys.executable, str(KIT / "make_models.py"), str(work), "mlp"], check=True, capture_output=True)
    config = model_config_file(work, {"mlp": work / "mlp", "hp": HALF_PLUS_TWO_TF1})
    daemon = Daemon([f"--model_config_file={config}", *a.servex_flag], work, rest=True).wait_serving()
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "mlp"
    request.inputs["features"].CopyFrom(tf.make_tensor_proto(np.random.default_rng(0).random((1, 64), np.float32)))
    big = predict_pb2.PredictRequest()
    big.model_spec.name = "hp"
    big.inputs["x"].CopyFrom(tf.make_tensor_proto([1.0], dtype=tf.float32, shape=[ROWS, 1]))
    big_file = work / "never_read.pb"
    big_file.write_bytes(big.SerializeToString())
    stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
    callers = Callers(stub, request, a.callers)
    pid = daemon.proc.pid
    blocks: list[dict] = []
    pooled: dict[str, list[float]] = {"without": [], "with": []}
    try:
        time.sleep(2)  # warm-up
        callers.take()
        order = [("without", "with") if i % 2 == 0 else ("with", "without") for i in range(a.blocks)]
        for condition in (c for pair in order for c in pair):
            driver = None
            if condition == "with":
                cmd = [sys.executable, __file__, "--slow_clients", daemon.address, str(daemon.rest_port), str(big_file)]
                driver = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
                if driver.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"the slow clients did not start: {driver.wait()}")
            callers.take()
            cpu, driver_cpu = _cpu_s(pid), _cpu_s(driver.pid) if driver else 0.0
            time.sleep(a.seconds)
            latencies = callers.take()
            block = {"condition": condition, **summary(latencies), "servex_rss_mb": _rss_mb(pid),
                     "servex_cpu_s": round(_cpu_s(pid) - cpu, 2)}  # fmt: skip
            if driver is not None:
                block["slow_clients_cpu_s"] = round(_cpu_s(driver.pid) - driver_cpu, 2)
                driver.kill()
                driver.wait()
                time.sleep(1)  # servex sees the connections go
            pooled[condition] += latencies
            blocks.append(block)
            print(json.dumps(block), flush=True)
    finally:
        callers.close()
        daemon.stop()
    result = {name: summary(values) for name, values in pooled.items()}
    result["p99_ratio"] = round(result["with"]["p99_ms"] / result["without"]["p99_ms"], 3)
    result["p50_ratio"] = round(result["with"]["p50_ms"] / result["without"]["p50_ms"], 3)
    with_, without = ([b for b in blocks if b["condition"] == c] for c in ("with", "without"))
    median_ratio = statistics.median(w["p99_ms"] / wo["p99_ms"] for w, wo in zip(with_, without, strict=True))
    result["p99_ratio_median_of_pairs"] = round(median_ratio, 3)
    result["goal"] = "p99 with slow clients at most 1.5x without"
    result["callers"], result["slow_clients"] = a.callers, {"rest_tricklers": SLOW, "grpc_never_readers": SLOW}
    result["servex_flags"] = a.servex_flag
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
