"""What a call costs on this machine when its answer comes after a wait: the floor under servex's 1-caller latency.

    python scripts/bench_wait.py [--waits 0,1,5,15] [--bytes 150000] [--calls 300]

Two do-nothing servers, each in its own process, answer a request of ``--bytes`` bytes (MobileNetV2's image is
about 150 KB) with 4,000 bytes after a wait of W ms, spent spinning on a worker thread as a run would, the event loop
free meanwhile: a grpc.aio server called through grpcio's sync client, and a plain asyncio TCP server (a length-
prefixed message, no HTTP/2, no gRPC) called through a blocking socket. One caller, one call at a time. Prints, per
server and wait, the mean and median of (a call's time - W): what the call itself cost. On the 2-core benchmark VM
the cost grows with the wait (threads and cores come back from idling), which in-process TensorFlow, timed back to
back, never pays (docs/performance.md).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from scripts.bench_peers import free_port  # noqa: E402

METHOD = "/bench.Wait/Call"
ANSWER = b"x" * 4000


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def grpc_server(port: int, ready) -> None:
    async def main():
        loop = asyncio.get_running_loop()

        async def call(request: bytes, context) -> bytes:
            wait = struct.unpack(">I", request[:4])[0] / 1e6
            if wait:
                await loop.run_in_executor(None, spin, wait)
            return ANSWER

        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 1 << 26)])
        handler = grpc.unary_unary_rpc_method_handler(call)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Wait", {"Call": handler}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


def tcp_server(port: int, ready) -> None:
    async def main():
        loop = asyncio.get_running_loop()

        async def serve(reader, writer):
            while True:
                try:
                    size, micros = struct.unpack(">II", await reader.readexactly(8))
                    await reader.readexactly(size)
                except asyncio.IncompleteReadError:
                    return
                if micros:
                    await loop.run_in_executor(None, spin, micros / 1e6)
                writer.write(struct.pack(">I", len(ANSWER)) + ANSWER)
                await writer.drain()

        server = await asyncio.start_server(serve, "127.0.0.1", port)
        ready.set()
        await server.serve_forever()

    asyncio.run(main())


def grpc_calls(port: int, body: bytes, wait_ms: float, calls: int) -> list[float]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(METHOD)
        request = struct.pack(">I", int(wait_ms * 1000)) + body
        return timed(lambda: call(request), calls)


def tcp_calls(port: int, body: bytes, wait_ms: float, calls: int) -> list[float]:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        request = struct.pack(">II", len(body), int(wait_ms * 1000)) + body

        def receive(n: int) -> bytes:
            data = bytearray()
            while len(data) < n:
                data += s.recv(n - len(data))
            return bytes(data)

        def call():
            s.sendall(request)
            receive(struct.unpack(">I", receive(4))[0])

        return timed(call, calls)


def timed(call, calls: int) -> list[float]:
    for _ in range(10):  # warm
        call()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waits", default="0,1,5,15", help="ms, comma-separated")
    ap.add_argument("--bytes", type=int, default=150_000)
    ap.add_argument("--calls", type=int, default=300)
    a = ap.parse_args()
    body = b"a" * a.bytes
    for name, serve, client in (("grpc.aio", grpc_server, grpc_calls), ("asyncio TCP", tcp_server, tcp_calls)):
        port, ready = free_port(), multiprocessing.Event()
        server = multiprocessing.Process(target=serve, args=(port, ready), daemon=True)
        server.start()
        try:
            if not ready.wait(30):
                raise RuntimeError(f"the {name} server did not start")
            for wait in (float(w) for w in a.waits.split(",")):
                over = [1000 * t - wait for t in client(port, body, wait, a.calls)]
                print(f"{name}, answer {wait:g} ms after the call: the call cost {statistics.mean(over):.2f} ms "
                      f"(median {statistics.median(over):.2f})", flush=True)  # fmt: skip
        finally:
            server.kill()


if __name__ == "__main__":
    main()
