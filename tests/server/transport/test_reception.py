"""Reception (server/transport/reception.py): with a memory limit, a unary call's message is read only when it
fits; a real grpc.aio server and client, the process's real resident memory, a limit set around it."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from prometheus_client import REGISTRY

from servex.executor.memory import MEMORY, MIN_MARGIN
from servex.server.transport import reception
from servex.server.transport.reception import RECEPTION, gated


def refused_messages() -> float:
    return REGISTRY.get_sample_value("servex_memory_refused_total", {"what": "message"}) or 0.0


def limit_with_room(room: int) -> None:
    """Configure the process's budget so that ``room`` bytes are free now."""
    usable = MEMORY.resident() + MEMORY.reserved + room
    MEMORY.configure(usable + max(usable // 9, MIN_MARGIN), "a test's limit")


@pytest.fixture
def budget():
    yield MEMORY
    MEMORY.configure(0, "")
    RECEPTION.largest = reception.MIN_EXPECTED


@pytest.fixture
def server():
    """An echo method, gated; what it served ("served:" + the request, or "refused: " + the message)."""

    async def echo(request, context):
        return request

    plain = grpc.unary_unary_rpc_method_handler(echo, lambda b: b, lambda b: b)
    handler = gated(plain, lambda message: b"refused: " + message.encode())
    assert handler.request_streaming and not handler.response_streaming
    port, started, stop = [0], threading.Event(), []

    def serve():
        async def main():
            s = grpc.aio.server()
            s.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t", {"Echo": handler})])
            port[0] = s.add_insecure_port("127.0.0.1:0")
            await s.start()
            stop.append((asyncio.get_running_loop(), s))
            started.set()
            await s.wait_for_termination()

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait(30)
    with grpc.insecure_channel(f"127.0.0.1:{port[0]}") as channel:
        yield channel.unary_unary("/t/Echo")
    loop, s = stop[0]
    asyncio.run_coroutine_threadsafe(s.stop(None), loop)
    thread.join(30)


def test_a_message_is_read_at_once_while_it_fits(budget, server):
    limit_with_room(512 << 20)
    assert RECEPTION.fits()
    assert server(b"hello", timeout=30) == b"hello"


def test_without_room_the_call_waits_then_is_refused_unread(budget, server, monkeypatch):
    monkeypatch.setattr(reception, "MAX_WAIT_SECONDS", 0.3)
    limit_with_room(-64 << 20)  # less than nothing: the process holds more than it may
    assert not RECEPTION.fits()
    refused = refused_messages()
    answer = server(b"x" * 1000, timeout=30).decode()
    assert answer.startswith("refused: the request was not received"), answer
    assert "(the memory limit of" in answer and "from a test's limit" in answer
    assert refused_messages() == refused + 1  # counted with the other memory refusals


def test_a_waiting_call_is_read_once_memory_is_freed(budget, server, monkeypatch):
    monkeypatch.setattr(reception, "MAX_WAIT_SECONDS", 30)
    limit_with_room(-64 << 20)
    assert not RECEPTION.fits()
    answer = server.future(b"waits", timeout=60)
    threading.Timer(0.5, limit_with_room, (512 << 20,)).start()  # memory freed meanwhile
    assert answer.result() == b"waits"


def test_the_expected_size_follows_the_largest_message_seen(budget):
    limit_with_room(64 << 20)
    assert RECEPTION.fits()
    RECEPTION.seen(32 << 20)  # four copies of it would not fit in 64 MiB
    assert RECEPTION.largest == 32 << 20 and not RECEPTION.fits()
    RECEPTION.seen(1000)  # smaller ones do not lower it while it is recent
    assert RECEPTION.largest == 32 << 20
