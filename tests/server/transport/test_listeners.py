"""ListenerGroup: several grpc.aio servers with the same services on one port (real gRPC, real sockets)."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from servex.server.transport.listeners import ListenerGroup
from tests.support.daemon import accept_queues, listening_sockets

SERVICE = "servex.test.Echo"


def _group(count: int, shared_port: bool = False) -> ListenerGroup:
    """A group answering Echo/Say (a generic handler) and Echo/Shout (a registered method)."""
    group = ListenerGroup(count, [("grpc.so_reuseport", 0)], shared_port)  # the group sets its own

    async def say(request: bytes, context) -> bytes:
        return request

    async def shout(request: bytes, context) -> bytes:
        return request.upper()

    group.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Say": grpc.unary_unary_rpc_method_handler(say)}),)
    )
    group.add_registered_method_handlers(SERVICE, {"Shout": grpc.unary_unary_rpc_method_handler(shout)})
    return group


def _channel(port: int) -> grpc.aio.Channel:
    """A channel with its own connection (no subchannel shared with the test's other channels)."""
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])


def test_every_listener_binds_the_port_and_connections_are_served_whichever_takes_them():
    async def main() -> None:
        group = _group(4)
        port = group.add_insecure_port("127.0.0.1:0")
        await group.start()
        try:
            assert port > 0
            assert listening_sockets(port) == 4
            channels = [_channel(port) for _ in range(16)]
            say = [c.unary_unary(f"/{SERVICE}/Say") for c in channels]
            shout = [c.unary_unary(f"/{SERVICE}/Shout", _registered_method=True) for c in channels]
            said = await asyncio.gather(*(call(f"hello {i}".encode(), timeout=10) for i, call in enumerate(say)))
            shouted = await asyncio.gather(*(call(f"hey {i}".encode(), timeout=10) for i, call in enumerate(shout)))
            assert said == [f"hello {i}".encode() for i in range(16)]
            assert shouted == [f"HEY {i}".encode() for i in range(16)]
            for c in channels:
                await c.close()
            assert await group.wait_for_termination(0.05) is True  # still serving
        finally:
            await group.stop(None)
        assert listening_sockets(port) == 0
        assert await group.wait_for_termination(1) is False

    asyncio.run(main())


def test_a_port_another_process_listens_on_is_refused_with_one_listener_or_several():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def bind(count: int) -> None:
            _group(count).add_insecure_port(f"127.0.0.1:{port}")

        with pytest.raises(RuntimeError, match="Failed to bind"):  # gRPC's own refusal
            asyncio.run(bind(1))
        with pytest.raises(OSError) as info:  # the probe's, before any listener binds with SO_REUSEPORT
            asyncio.run(bind(3))
        assert "in use" in str(info.value)


def test_a_second_group_does_not_share_the_first_one_s_port_unless_it_is_one_of_a_process_group():
    async def main() -> None:
        first = _group(2)
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            with pytest.raises(OSError):  # SO_REUSEPORT alone would have let it in, splitting the traffic
                _group(2).add_insecure_port(f"127.0.0.1:{port}")
            assert listening_sockets(port) == 2
        finally:
            await first.stop(None)

        shared = [_group(2, shared_port=True) for _ in range(2)]  # --serving_processes: sharing is the point
        port = shared[0].add_insecure_port("127.0.0.1:0")
        assert shared[1].add_insecure_port(f"127.0.0.1:{port}") == port
        assert listening_sockets(port) == 4
        for group in shared:
            await group.start()
            await group.stop(None)

    asyncio.run(main())


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _connect_from_ports_two_apart(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` connections to ``host:port`` from even source ports two apart, in the kernel's ephemeral range
    (what Linux gives one host's connections to one address, give or take a few ports)."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(50):
        base = random.randrange(low, high - 2 * count) & ~1
        clients: list[socket.socket] = []
        try:
            for i in range(count):
                clients.append(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET))
                clients[-1].bind((host, base + 2 * i))
        except OSError:  # a source port in use: other ones (before any connection is made)
            for c in clients:
                c.close()
            continue
        for c in clients:
            c.connect((host, port))
        return clients
    raise RuntimeError("no free run of source ports")


def _accept_queues_after(listeners: int, shared_port: bool, bound: str, client: str, connections: int) -> list[int]:
    """Bind a group of ``listeners`` (not started) to ``bound``, connect ``connections`` clients from ``client``
    (source ports two apart) and return each listener's accept queue once they all wait there (/proc/net's)."""

    async def main() -> list[int]:
        group = _group(listeners, shared_port)
        port = group.add_insecure_port(f"{bound}:0")
        clients = _connect_from_ports_two_apart(client, port, connections)
        try:
            deadline = time.monotonic() + 10
            while sum(accept_queues(port)) < connections and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return sorted(accept_queues(port))
        finally:
            for c in clients:
                c.close()
            await group.stop(None)

    return asyncio.run(main())


@pytest.mark.parametrize(
    "bound, client", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1")] + [("[::1]", "::1")] * _ipv6_loopback()
)
def test_a_clients_connections_go_one_to_each_listener_by_source_port(bound, client):
    # Hashed by their addresses, 16 connections would land one on each of 16 listeners about once in a million
    # tries; by source port they always do.
    assert _accept_queues_after(16, False, bound, client, 16) == [1] * 16


def test_a_process_groups_listeners_are_left_to_the_kernels_hash():
    # With --serving_processes the port's group holds every process's listeners, which no one process counts: a
    # program over its own would leave the others' idle.
    queues = _accept_queues_after(16, True, "127.0.0.1", "127.0.0.1", 64)
    assert sum(queues) == 64
    assert queues != [4] * 16  # hashed: by source port, 4 each


def test_a_group_is_a_grpc_aio_server_so_reflection_serves_its_asyncio_servicer_on_every_listener():
    async def main() -> None:
        group = _group(3)
        assert isinstance(group, grpc.aio.Server)
        reflection.enable_server_reflection([SERVICE, reflection.SERVICE_NAME], group)
        port = group.add_insecure_port("127.0.0.1:0")
        await group.start()
        try:
            for _ in range(6):  # several connections: the kernel spreads them over the listeners
                async with _channel(port) as channel:
                    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                    request = reflection_pb2.ServerReflectionRequest(list_services="")
                    answers = [a async for a in stub.ServerReflectionInfo(iter([request]), timeout=10)]
                    names = {s.name for s in answers[0].list_services_response.service}
                    assert names == {SERVICE, reflection.SERVICE_NAME}
        finally:
            await group.stop(None)

    asyncio.run(main())


def test_a_group_needs_a_listener():
    with pytest.raises(ValueError, match="at least 1"):
        ListenerGroup(0, [])


GENERIC_ONLY = "/servex.test.Generic/Only"


def test_methods_are_served_from_one_table_per_listener():
    """Registered methods cost grpcio's asyncio server an asyncio.wait over all of them per call, and each generic
    handler a Python call per call (see ListenerGroup.add_registered_method_handlers): every listener has one
    generic handler, the group's method table; handlers added only as generic ones are asked after it, in order."""

    async def main() -> None:
        group = ListenerGroup(2, [])

        async def say(request: bytes, context) -> bytes:
            return b"said " + request

        async def shout(request: bytes, context) -> bytes:
            return b"SAID " + request

        handlers = {"Say": grpc.unary_unary_rpc_method_handler(say)}
        group.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        group.add_registered_method_handlers(SERVICE, handlers)  # what generated code does next
        group.add_registered_method_handlers(SERVICE, {"Again": handlers["Say"]})  # a method not served yet
        group.add_registered_method_handlers("servex.test.Other", handlers)  # another service
        generic_only = {"Only": grpc.unary_unary_rpc_method_handler(say)}  # GENERIC_ONLY
        group.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("servex.test.Generic", generic_only),))
        # a method an earlier generic handler serves stays with it, as in gRPC; the first registration wins too
        group.add_registered_method_handlers(SERVICE, {"Say": grpc.unary_unary_rpc_method_handler(shout)})
        group.add_registered_method_handlers("servex.test.Other", {"Say": grpc.unary_unary_rpc_method_handler(shout)})
        assert sorted(group._table.methods) == [f"/{SERVICE}/Again", f"/{SERVICE}/Say", "/servex.test.Other/Say"]
        assert len(group._table.generic) == 2
        port = group.add_insecure_port("127.0.0.1:0")
        await group.start()
        try:
            async with _channel(port) as channel:
                for method in (f"/{SERVICE}/Say", f"/{SERVICE}/Again", "/servex.test.Other/Say", GENERIC_ONLY):
                    assert await channel.unary_unary(method)(b"x", timeout=10) == b"said x", method
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await channel.unary_unary(f"/{SERVICE}/Missing")(b"x", timeout=10)
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await group.stop(None)

    asyncio.run(main())
