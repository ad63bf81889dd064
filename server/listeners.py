"""The gRPC port served by several grpc.aio servers in one process (``--grpc_listeners``).

grpcio's asyncio server accepts calls one at a time: a listener asks gRPC core for the next call of a method only
once the last one has been handed to its task, a chain of several event-loop turns per call (asyncio.wait over
every method, then a new task; grpc/grpc#43461). Under load that chain, not the work, is what limits a process:
the loop idles while calls wait in gRPC core (measured on the MLP at 32 callers: the loop thread 79% busy, the
machine 54% idle). Several listeners on one port accept in parallel: each binds it with SO_REUSEPORT and the
kernel spreads incoming connections over them. They share one event loop, one set of servicers and one
ServingCore, so nothing else changes; a connection stays with the listener that accepted it, so one client
channel (one connection) is still served by one listener.

A group is a ``grpc.aio.Server`` to the generated ``add_*Servicer_to_server`` functions, health and reflection
(which checks): whatever is added is added to every listener.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

import grpc


class ListenerGroup(grpc.aio.Server):
    """``count`` grpc.aio servers with the same services on the same port.

    ``shared_port``: this process is one of several serving processes on the port (``--serving_processes``), so
    the port is meant to be shared. Otherwise a port another process is using fails the bind, as it does with one
    listener, although the listeners share it among themselves.
    """

    def __init__(self, count: int, options: Sequence[tuple[str, object]], shared_port: bool = False):
        if count < 1:
            raise ValueError(f"a listener group needs at least 1 listener, got {count}")
        reuse = 1 if count > 1 or shared_port else 0
        options = [(k, v) for k, v in options if k != "grpc.so_reuseport"] + [("grpc.so_reuseport", reuse)]
        self.servers = [grpc.aio.server(options=options) for _ in range(count)]
        self.shared_port = shared_port

    def add_generic_rpc_handlers(self, handlers) -> None:
        for server in self.servers:
            server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers) -> None:
        """Added as a generic handler (what the generated code asks for as a registered method).

        grpcio's asyncio server waits for the next call with one pending request per registered method plus one
        for the generic ones, through an asyncio.wait over all of them per call: 15.1 µs with servex's 29
        registered methods against 7.2 µs with one (in process). As generic handlers: 7,117 req/s against 6,735
        on the MLP at 32 callers with batching (means of 6 alternating runs; generic won 5 of the 6 pairs)."""
        self.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, method_handlers),))

    def add_insecure_port(self, address: str) -> int:
        """Bind every listener to ``address`` ("host:port"; port 0 picks a free one for all); the port bound.

        Raises OSError when the port is taken by another process, RuntimeError when gRPC cannot bind it.
        """
        return self._bind(address, lambda server, where: server.add_insecure_port(where))

    def add_secure_port(self, address: str, server_credentials) -> int:
        return self._bind(address, lambda server, where: server.add_secure_port(where, server_credentials))

    def _bind(self, address: str, add) -> int:
        host, _, port = address.rpartition(":")
        if len(self.servers) > 1 and not self.shared_port and int(port):
            refuse_if_taken(host, int(port))
        bound = add(self.servers[0], address)
        for server in self.servers[1:]:
            add(server, f"{host}:{bound}")
        return bound

    async def start(self) -> None:
        for server in self.servers:
            await server.start()

    async def stop(self, grace: float | None) -> None:
        await asyncio.gather(*(server.stop(grace) for server in self.servers))

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Until every listener has stopped; True when ``timeout`` passed first (as grpc.aio.Server's)."""
        timed_out = await asyncio.gather(*(server.wait_for_termination(timeout) for server in self.servers))
        return any(timed_out)


def refuse_if_taken(host: str, port: int) -> None:
    """OSError (EADDRINUSE) when any socket listens on ``host:port``, SO_REUSEPORT ones included.

    The listeners bind with SO_REUSEPORT, so on their own they would share a port with another process that did
    too (a second servex, say) instead of failing. A probe bound without SO_REUSEPORT fails on any listener.
    """
    name = host.strip("[]") or None
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(name, port, type=socket.SOCK_STREAM,
                                                                flags=socket.AI_PASSIVE):  # fmt: skip
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT is no user
            probe.bind(sockaddr)
