"""Slow REST clients starve no one: with the real daemon, 50 clients that trickle their request bodies a byte at a
time are answered 408 and dropped once --rest_api_body_timeout_in_ms passes, while other callers are served
throughout."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest

from tests.conftest import HALF_PLUS_TWO_TF1

pytestmark = pytest.mark.integration

SLOW_CLIENTS = 50
BODY = b'{"instances": [1.0, 2.0, 5.0]}'


def _trickle(port: int, out: dict, i: int, stop: threading.Event) -> None:
    """Send the headers, then the body a byte every 0.2 s; record what the server answered and whether it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        head = (f"POST /v1/models/hp:predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(BODY)}\r\n\r\n")  # fmt: skip
        sock.sendall(head.encode())
        sock.settimeout(0.2)
        answer = b""
        for byte in BODY[:-1]:  # never the last byte
            if stop.is_set():
                break
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                chunk = None
            if chunk == b"":
                break  # closed by the server
            if chunk:
                answer += chunk
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
        sock.settimeout(10)
        try:
            while chunk := sock.recv(65536):
                answer += chunk
            closed = True
        except TimeoutError:
            closed = False
        out[i] = (answer, closed)


def test_clients_trickling_their_bodies_are_dropped_and_others_are_served(start_daemon):
    daemon = start_daemon(f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=hp",
                          "--rest_api_body_timeout_in_ms=1500", rest=True)  # fmt: skip
    port = int(daemon.rest_url.rsplit(":", 1)[1])
    out: dict[int, tuple[bytes, bool]] = {}
    stop = threading.Event()
    slow = [threading.Thread(target=_trickle, args=(port, out, i, stop)) for i in range(SLOW_CLIENTS)]
    for t in slow:
        t.start()
    served = []
    deadline = time.monotonic() + 3  # while the slow clients hold their connections, and past their timeout
    while time.monotonic() < deadline:
        request = urllib.request.Request(f"{daemon.rest_url}/v1/models/hp:predict", BODY)
        with urllib.request.urlopen(request, timeout=10) as reply:
            served.append(json.loads(reply.read()))
    stop.set()
    for t in slow:
        t.join(30)
    assert served and all(answer == {"predictions": [2.5, 3.0, 4.5]} for answer in served)
    assert len(out) == SLOW_CLIENTS
    for answer, closed in out.values():
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"--rest_api_body_timeout_in_ms" in answer and closed
