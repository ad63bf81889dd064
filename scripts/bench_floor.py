"""Where servex's time goes at 32 callers: a ladder of gRPC servers, each adding one part of servex's path.

    python scripts/bench_floor.py [--seconds 6] [--concurrency 1,32] [--workdir /tmp/servex-bench] [--in_process]

Every rung answers the kit's batch-1 KServe v2 ModelInfer on the MLP over loopback, driven by the kit's h2load
driver (h2grpc.py, 4 connections at 32 callers), one server at a time:
- echo: the kit's do-nothing grpc.aio server (echo_floor.py), the floor of one grpc.aio server;
- listeners: the same fixed answer from servex's ListenerGroup (``--grpc_listeners``, default 32 grpc.aio servers
  on the port), the floor of the rungs below, which all use it;
- handoff: the same, but each call goes through servex's RunHandler to a worker thread and back (no TensorFlow);
- tf: the same, and the worker runs the MLP's client graph through servex's GraphExecutor (the real run, a
  fixed answer: no request decoding or response encoding);
- servex: the daemon itself (decode, core, RunHandler, run, encode, metrics).
The drop from one rung to the next is what that part costs under load. Last, servex's own ModelInfer without
gRPC: KServeService called in process by 1 and 32 concurrent coroutines, without and with batching, CPU time per
request of the event loop's thread and of the whole process (``--in_process``: only that, in about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT = REPO.parent / "shared" / "bench"
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SERVICE = "inference.GRPCInferenceService"


def serve(mode: str, port: int, model_dir: str) -> None:
    """One rung (listeners, handoff or tf) as a gRPC server on ``port``, until killed."""
    import grpc
    import numpy as np

    from servex.executor.run_handler import RunHandler, Ticket
    from servex.loader.config import ModelSpec
    from servex.protos.inference import grpc_service_pb2 as pb
    from servex.server.app import make_manager
    from servex.server.config.settings import ServerSettings
    from servex.server.transport.listeners import ListenerGroup

    settings = ServerSettings()
    answer = pb.ModelInferResponse(model_name="mlp")
    answer.outputs.add(name="score", datatype="FP32", shape=[1, 1])
    answer.raw_output_contents.append(np.zeros(1, np.float32).tobytes())
    fixed = answer.SerializeToString()
    work = lambda: fixed  # noqa: E731
    if mode == "tf":
        manager = make_manager(settings)  # the daemon's session options and transfer executor
        problems = manager.apply_config([ModelSpec("mlp", model_dir)])
        if problems:
            sys.exit(f"cannot load {model_dir}: {problems}")
        executor = manager.acquire("mlp").servable
        sig = executor.model.signatures["serving_default"]
        feeds = {sig.inputs["features"].name: np.ones((1, 64), np.float32)}
        fetches = [sig.outputs["score"].name]

        def work():
            executor.run(feeds, fetches)
            return fixed

    handler = RunHandler(settings.num_run_workers)
    ticket = Ticket(0, None, "mlp", ("mlp", "1", "serving_default"))

    async def infer(request: bytes, context) -> bytes:
        if mode == "listeners":
            return fixed
        return await handler.submit(work, ticket=ticket)

    async def main() -> None:
        server = ListenerGroup(settings.grpc_listeners, [])
        method = grpc.unary_unary_rpc_method_handler(infer)  # bytes in, bytes out: nothing parsed
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"ModelInfer": method}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def in_process(model_dir: str, rounds: int = 7, requests: int = 19_200) -> None:
    """servex's ModelInfer without gRPC: the handler called directly by 1 and 32 concurrent coroutines, without
    and with batching (max 32); CPU per request of the event loop's thread and of the process, medians of
    ``rounds`` rounds of ``requests`` calls (after a warm-up)."""
    import statistics

    import numpy as np
    from grpc_health.v1 import health

    from servex.executor.run_handler import BatchingOptions, RunHandler
    from servex.protos.inference import grpc_service_pb2 as pb
    from servex.server.app import make_manager
    from servex.server.config.settings import ServerSettings
    from servex.server.core import ServingCore
    from servex.server.lifecycle import Lifecycle, initial_specs
    from servex.server.protocols.kserve import grpc_api as kserve
    from servex.server.protocols.kserve.dataplane import DataPlane

    class Context:  # what the rpc wrapper reads of a call: no metadata, no deadline
        def invocation_metadata(self):
            return ()

        def time_remaining(self):
            return None

    async def run() -> None:
        settings = ServerSettings(model_name="mlp", model_base_path=model_dir)
        manager = make_manager(settings)
        await Lifecycle(manager, health.aio.HealthServicer(), settings).apply(initial_specs(settings)[0])
        request = pb.ModelInferRequest(model_name="mlp")
        request.inputs.add(name="features", datatype="FP32", shape=[1, 64])
        request.raw_input_contents.append(np.ones((1, 64), np.float32).tobytes())
        data, context = request.SerializeToString(), Context()
        for batching in (None, BatchingOptions(32)):
            handler = RunHandler(settings.num_run_workers, batching=batching)
            service = kserve.KServeService(DataPlane(ServingCore(manager, handler, settings.pin_signature_graphs)))

            async def caller(n: int, service=service) -> None:
                for _ in range(n):
                    await service.ModelInfer(pb.ModelInferRequest.FromString(data), context)

            await caller(2000)  # warm: client graph built, caches filled
            for concurrency in (1, 32):
                n = requests // concurrency * concurrency
                figures = []
                for _ in range(rounds):
                    wall, loop_cpu, cpu = time.perf_counter(), time.thread_time(), time.process_time()
                    await asyncio.gather(*[caller(n // concurrency) for _ in range(concurrency)])
                    spent = (time.perf_counter() - wall, time.thread_time() - loop_cpu, time.process_time() - cpu)
                    figures.append(spent)
                wall_s, loop_s, cpu_s = (statistics.median(f[i] for f in figures) for i in range(3))
                row = {"in_process_concurrency": concurrency, "batching": batching is not None,
                       "loop_cpu_us": round(1e6 * loop_s / n, 1), "process_cpu_us": round(1e6 * cpu_s / n, 1),
                       "wall_us": round(1e6 * wall_s / n, 1)}  # fmt: skip
                print(json.dumps(row), flush=True)
            handler.close()

    asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "servex-bench"))
    ap.add_argument("--in_process", action="store_true", help="only servex's ModelInfer without gRPC (no h2load)")
    ap.add_argument("--serve", nargs=3, metavar=("MODE", "PORT", "MODEL_DIR"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        if a.serve[0] == "in_process":
            in_process(a.serve[2])
        else:
            serve(a.serve[0], int(a.serve[1]), a.serve[2])
        return
    sys.path.insert(0, str(KIT))
    from bench_peers import free_port, servers, wait_ready  # the peer benchmark's helpers
    from h2grpc import run as h2load_run  # the kit's driver
    from loadgen import build

    work = Path(a.workdir)
    subprocess.run([sys.executable, str(KIT / "make_models.py"), str(work), "mlp"], check=True, capture_output=True)
    payload = build("mlp", "features", [1, 64], "FP32")
    frame = work / "infer.grpc"
    frame.write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
    model = work / "mlp"
    if a.in_process:
        subprocess.run([sys.executable, __file__, "--serve", "in_process", "0", str(model)], cwd=REPO, check=True,
                       stderr=subprocess.DEVNULL)  # fmt: skip
        return
    peer_servers = servers(work, Path(tempfile.gettempdir()))  # the peer benchmark's echo and servex commands
    rungs = {
        "echo": peer_servers["echo"],
        "listeners": lambda port: [sys.executable, __file__, "--serve", "listeners", str(port), str(model / "1")],
        "handoff": lambda port: [sys.executable, __file__, "--serve", "handoff", str(port), str(model / "1")],
        "tf": lambda port: [sys.executable, __file__, "--serve", "tf", str(port), str(model)],
        "servex": peer_servers["servex"],
    }
    levels = [int(c) for c in a.concurrency.split(",")]
    rows = {}
    for name, command in rungs.items():
        port = free_port()
        proc = subprocess.Popen(command(port), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
        try:
            wait_ready(port, proc)
            time.sleep(1)
            rows[name] = {}
            for c in levels:
                r = h2load_run(port, str(frame), c, a.seconds, f"/{SERVICE}/ModelInfer")
                r["server"] = name
                print(json.dumps(r), flush=True)
                rows[name][c] = r
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print()
    print("| rung | " + " | ".join(f"c={c} req/s | c={c} mean ms" for c in levels) + " |")
    print("| --- " * (2 * len(levels) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[c]['rps']:,.0f} | {row[c]['mean_ms']}" for c in levels) + " |")
    print()
    subprocess.run([sys.executable, __file__, "--serve", "in_process", "0", str(model)], cwd=REPO, check=True,
                   stderr=subprocess.DEVNULL)  # fmt: skip


if __name__ == "__main__":
    main()
