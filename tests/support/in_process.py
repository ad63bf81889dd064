"""servex's parts in the test's own process: a ServingCore over a real SavedModel, and a grpc.aio server on an
event loop of its own thread, so that protocol adapters are called through real gRPC in milliseconds."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

import grpc

from tests.conftest import HALF_PLUS_TWO_TF1


@contextlib.contextmanager
def serving_core(name: str = "hp", path=HALF_PLUS_TWO_TF1) -> Iterator:
    """A started ServingCore serving the SavedModel at ``path`` (default: half_plus_two, y = 0.5 x + 2, version
    123) as ``name``, with one run worker."""
    from servex.executor import RunHandler
    from servex.loader.config import ModelSpec
    from servex.server.app import make_manager
    from servex.server.config.settings import ServerSettings
    from servex.server.core import ServingCore

    manager = make_manager(ServerSettings(num_run_workers=1))
    assert not manager.apply_config([ModelSpec(name, str(path))])
    run_handler = RunHandler(1)
    core = ServingCore(manager, run_handler, max_tensor_bytes=1 << 20)
    core.started = True
    try:
        yield core
    finally:
        run_handler.close()
        manager.unload_all()


@contextlib.contextmanager
def _loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


@contextlib.contextmanager
def rest_server(core, *add_routes) -> Iterator[str]:
    """servex's REST server (aiohttp) over ``core`` with these protocols' routes, on 127.0.0.1 and its own thread's
    event loop; yields its base URL."""
    from servex.server.transport.http import RestServer
    from tests.support.ports import free_port

    port = free_port()
    with _loop_thread() as loop:
        server = RestServer(core, port, "127.0.0.1", 1 << 20, 30.0, 0.0, routes=add_routes)
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)


@contextlib.contextmanager
def aio_server(add_services: Callable[[grpc.aio.Server], None]) -> Iterator[grpc.Channel]:
    """A grpc.aio server on 127.0.0.1 (a free port) with the services ``add_services`` adds, run on its own
    thread's event loop; yields a channel to it."""
    with _loop_thread() as loop:
        with _serving(add_services, loop) as channel:
            yield channel


@contextlib.contextmanager
def _serving(add_services, loop) -> Iterator[grpc.Channel]:

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        add_services(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
