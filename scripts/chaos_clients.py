"""The chaos soak's faults on the client side (scripts/chaos_soak.py): REST clients trickling their bodies a byte at
a time, gRPC clients that open calls and never read the answers, and floods of large requests at once."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

import grpc
import numpy as np
from chaos_faults import one_connection
from chaos_outcomes import Tally
from soak_traffic import infer, predict
from tensorflow_serving.apis import prediction_service_pb2_grpc
from tritonclient.grpc import service_pb2_grpc

# -- REST clients that trickle their bodies ----------------------------------------------------------------------

TRICKLE_BODY = b'{"instances": [' + b"1.0, " * 200 + b"1.0]}"


def _seconds(s: float) -> str:
    return next((name for limit, name in ((1, "< 1 s"), (5, "1-5 s"), (15, "5-15 s")) if s < limit), "> 15 s")


def trickle_one(port: int, tally: Tally, stop: threading.Event, every_s: float = 0.25) -> None:
    """Headers, then the body a byte every ``every_s`` (never the last one) until servex answers: 408 once
    --rest_api_body_timeout_in_ms has passed, the connection closed within 30 s (``rest_trickle``; how long the
    close took is noted)."""
    start = time.monotonic()
    answer, closed = b"", False
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"POST /v1/models/hp2:predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(TRICKLE_BODY))  # fmt: skip
            sock.settimeout(every_s)
            for byte in TRICKLE_BODY[:-1]:
                if stop.is_set() or time.monotonic() - start > 60:
                    break
                try:
                    answer = sock.recv(65536)
                    closed = not answer
                    break  # answered (or closed): no more bytes
                except TimeoutError:
                    pass
                try:
                    sock.sendall(bytes([byte]))
                except OSError:  # closed by servex: its answer may wait to be read
                    break
            answered = time.monotonic()
            sock.settimeout(30)
            try:
                while not closed:
                    chunk = sock.recv(65536)
                    answer += chunk
                    closed = not chunk
            except ConnectionResetError:
                closed = True  # closed by servex with bytes of ours unread
            if answer and closed:
                tally.note(f"trickle: connection closed {_seconds(time.monotonic() - answered)} after the answer")
    except OSError:
        pass
    if not answer:
        outcome = "unexpected REST connection error" if closed or not stop.is_set() else "ok"  # ok: stopped first
    elif not answer.startswith(b"HTTP/1.1 "):
        outcome = f"unexpected answer {answer[:60]!r}"
    else:
        status = answer[9:12].decode(errors="replace")
        outcome = f"unexpected HTTP {status}" + ("" if closed else " (connection left open)")
    tally.record("rest_trickle", outcome, start, time.monotonic())


def trickle(port: int, tally: Tally, rng: random.Random, stop: threading.Event) -> None:
    clients = rng.randint(5, 30)
    tally.open("trickle", time.monotonic(), "rest")
    threads = [threading.Thread(target=trickle_one, args=(port, tally, stop), daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)


# -- gRPC clients that never read their answers (a hand-written minimum of HTTP/2: RFC 9113, HPACK RFC 7541) ---

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, GOAWAY = 0x0, 0x1, 0x4, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
INITIAL_WINDOW_SIZE = 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name (RFC 7541 6.2.2); both shorter than 127 bytes."""
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def grpc_call_frames(stream: int, path: str, message: bytes) -> bytes:
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "servex"),
               ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip
    block = b"".join(_literal(n, v) for n, v in headers)
    body = b"\x00" + struct.pack(">I", len(message)) + message  # not compressed, length, the message
    return frame(HEADERS, END_HEADERS, stream, block) + frame(DATA, END_STREAM, stream, body)


def received(sock: socket.socket) -> tuple[set[int], bool]:
    """What the server sent so far, read without waiting: the streams it sent headers on, and whether it sent
    GOAWAY or closed."""
    data, gone = b"", False
    sock.setblocking(False)
    try:
        while chunk := sock.recv(1 << 20):
            data += chunk
        gone = True
    except BlockingIOError:
        pass
    except OSError:
        gone = True
    answered = set()
    while len(data) >= 9:
        length = int.from_bytes(data[:3], "big")
        kind, stream = data[3], int.from_bytes(data[5:9], "big") & 0x7FFFFFFF
        answered |= {stream} if kind == HEADERS else set()
        gone |= kind == GOAWAY
        data = data[9 + length :]
    return answered, gone


def slow_grpc(port: int, tally: Tally, rng: random.Random, stop: threading.Event) -> None:
    """Connections that grant a window of 8 bytes, send a few Predict calls each, and never read, held 5-20 s."""
    tally.open("slow_grpc", time.monotonic(), "unread")
    message = predict("mlp", "features", np.ones((8, 64), np.float32)).SerializeToString()
    path = "/tensorflow.serving.PredictionService/Predict"
    socks, streams = [], (1, 3, 5)
    for _ in range(rng.randint(2, 8)):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", INITIAL_WINDOW_SIZE, 8)))
            sock.sendall(frame(SETTINGS, ACK, 0) + b"".join(grpc_call_frames(s, path, message) for s in streams))
            socks.append(sock)
        except OSError:
            tally.note("slow_grpc: could not connect")
    stop.wait(rng.uniform(5, 20))
    for sock in socks:
        answered, gone = received(sock)
        tally.note(f"slow_grpc: {len(answered & set(streams))} of {len(streams)} calls answered headers")
        if gone:
            tally.note("slow_grpc: connection ended by servex")
        sock.close()


# -- floods of large requests -------------------------------------------------------------------------------------

BIG = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


def flood_call(channel: grpc.Channel, api: str, x: np.ndarray, tally: Tally) -> None:
    """One large call of half_plus_two: OK with y = 0.5 x + 2, or RESOURCE_EXHAUSTED (``flood_predict``,
    ``flood_infer``)."""
    start = time.monotonic()
    try:
        if api == "predict":
            reply = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
                predict("hp2", "x", x), timeout=120
            )
            y = reply.outputs["y"]
            raw = y.tensor_content or np.array(y.float_val, np.float32).tobytes()
        else:
            reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(infer("hp2", "x", x), timeout=120)
            raw = reply.raw_output_contents[0]
        y = np.frombuffer(raw, np.float32)
        right = y.size == x.size and np.array_equal(y[::4099], x[::4099] * np.float32(0.5) + np.float32(2))
        outcome = "ok" if right else f"unexpected answer of {y.size} values"
    except grpc.RpcError as e:
        outcome = f"unexpected {e.code().name}: {(e.details() or '')[:200]}"
    except Exception as e:  # noqa: BLE001  (an answer that does not decode is an outcome to report)
        outcome = f"unexpected {type(e).__name__}: {e}"[:300]
    tally.record(f"flood_{api}", outcome, start, time.monotonic())


def flood(address: str, tally: Tally, rng: random.Random, calls: int, megabytes: int) -> None:
    """``calls`` calls of ``megabytes`` MB (float32 tensor_content or raw v2 contents) at once, over 4 connections."""
    x = np.random.default_rng(rng.randrange(1 << 30)).random((megabytes << 20) // 4, dtype=np.float32)
    window = tally.open("flood", time.monotonic(), f"{calls}x{megabytes}MB")
    channels = [one_connection(address, *BIG) for _ in range(4)]
    threads = [
        threading.Thread(target=flood_call, args=(channels[i % 4], rng.choice(("predict", "infer")), x, tally))
        for i in range(calls)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    finally:
        for channel in channels:
            channel.close()
        tally.close(window, time.monotonic())
