"""servex's REST port (``--rest_api_port``): an aiohttp server on the gRPC server's event loop that serves
TensorFlow Serving's REST API (``/v1/...``, server/rest_tfserving.py) and KServe v2 REST (``/v2/...``,
server/rest_v2.py).

This module owns what every REST call shares: the HTTP status of each error (TensorFlow Serving's mapping of
gRPC codes, below), the ``{"error": "..."}`` body, request metrics (the same ``servex_requests_total`` and
latency histogram as gRPC, methods ``rest:*``), the call's priority (header ``x-servex-priority``, as the gRPC
metadata) and deadline (``--rest_api_timeout_in_ms``, TensorFlow Serving's flag), and reading the body: at
most ``--max_message_bytes`` on the wire and again after ``Content-Encoding: gzip``/``deflate`` is undone, so
that a compressed bomb is answered 413 having inflated no more than the limit. Answers of 1 KiB or more are
compressed (deflate or gzip) when the request's ``Accept-Encoding`` allows it, as Triton does for
tritonclient's ``response_compression_algorithm``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

from loader.errors import InvalidArgument, ServingError
from server.core import REQUEST, RequestInfo, ServingCore, priority_from_text
from server.rpc import PRIORITY_METADATA, record

log = logging.getLogger(__name__)

# TensorFlow Serving's REST status for each gRPC code (tensorflow_serving/model_servers/http_server.cc).
HTTP_STATUS = {
    "OK": 200,
    "CANCELLED": 499,
    "UNKNOWN": 500,
    "INVALID_ARGUMENT": 400,
    "DEADLINE_EXCEEDED": 504,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "FAILED_PRECONDITION": 400,
    "ABORTED": 409,
    "OUT_OF_RANGE": 400,
    "UNIMPLEMENTED": 501,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DATA_LOSS": 500,
    "UNAUTHENTICATED": 401,
}
JSON = "application/json"
# Bodies (and outputs) larger than this are decoded (encoded) on a worker thread, not on the event loop.
OFFLOAD_BYTES = 1 << 20


class HttpError(ServingError):
    """A ServingError answered with its own HTTP status (413 for a body over the limit, 415 for an unknown
    Content-Encoding) while its gRPC code names it in metrics."""

    def __init__(self, message: str, code: str, status: int):
        super().__init__(message)
        self.code = code
        self.status = status


def status_of(error: ServingError) -> int:
    return getattr(error, "status", None) or HTTP_STATUS.get(error.code, 500)


def error_response(error: ServingError) -> web.Response:
    return web.Response(body=orjson.dumps({"error": error.message}), status=status_of(error), content_type=JSON)


def json_response(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type=JSON)


# Smaller answers go as they are: compressing them costs more time than it saves bytes.
COMPRESS_MIN_BYTES = 1024


def accepts_compression(request: web.Request) -> bool:
    accepted = request.headers.get("Accept-Encoding", "").lower()
    return "gzip" in accepted or "deflate" in accepted


def compressed(response: web.StreamResponse) -> web.StreamResponse:
    """A whole-body response, compressed (deflate or gzip, as the request's Accept-Encoding allows, deflate first)
    when its body is large enough; aiohttp compresses large bodies off the event loop. Streamed answers (already
    sent) go as they are."""
    body = response.body if isinstance(response, web.Response) else None
    if isinstance(body, bytes | bytearray) and len(body) >= COMPRESS_MIN_BYTES:
        response.enable_compression()  # a no-op without a matching Accept-Encoding
    return response


@dataclass
class Call:
    """What a handler tells the wrapper about the call, for metrics: its method and model."""

    method: str
    model: str = ""


Handler = Callable[[web.Request, Call, RequestInfo], Awaitable[web.StreamResponse]]


class Rest:
    """Shared state of the REST adapters: the core, the limits, and whether the server is draining."""

    def __init__(self, core: ServingCore, max_body_bytes: int, timeout_s: float):
        self.core = core
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self.draining = False

    def endpoint(self, method: str, handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """An aiohttp handler around ``handler``: errors become ``{"error": ...}`` with their HTTP status,
        and the call is counted and timed like a gRPC call."""

        async def handle(request: web.Request) -> web.StreamResponse:
            start = time.perf_counter()
            call = Call(method, request.match_info.get("name", ""))
            code = "OK"
            info = RequestInfo()
            try:
                info = self.request_info(request)
                REQUEST.set(info)
                return compressed(await handler(request, call, info))
            except ServingError as e:
                code = e.code
                return error_response(e)
            except RecursionError:  # JSON lists nested deeper than the codec walks
                error = InvalidArgument("the request's JSON is nested too deeply: a tensor has at most a few dozen")
                code = error.code
                return error_response(error)
            except Exception as e:
                code = "INTERNAL"
                log.exception("%s failed", call.method)
                return error_response(ServingError(f"internal error in {call.method}: {type(e).__name__}: {e}"))
            finally:
                record(self.core, call.method, call.model, info, code, start)

        return handle

    def request_info(self, request: web.Request) -> RequestInfo:
        priority = 0
        header = request.headers.get(PRIORITY_METADATA)
        if header is not None:
            priority = priority_from_text(header, f"header {PRIORITY_METADATA}")
        deadline = time.monotonic() + self.timeout_s if self.timeout_s > 0 else None
        return RequestInfo(priority, deadline)

    async def body(self, request: web.Request) -> bytes:
        """The request body, decompressed per Content-Encoding; 413 beyond ``max_body_bytes`` before or after."""
        limit = self.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise too_large(f"the request body has {request.content_length} bytes", limit)
        try:
            data = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large("the request body is larger", limit) from None
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            return data
        if encoding not in ("gzip", "x-gzip", "deflate"):
            raise HttpError(
                f"Content-Encoding {encoding!r} is not supported: send gzip, deflate or an uncompressed body",
                "INVALID_ARGUMENT",
                415,
            )
        # Off the loop whatever the compressed size: a small body may inflate to the whole limit.
        return await asyncio.get_running_loop().run_in_executor(None, inflate, data, encoding, limit)


def too_large(what: str, limit: int) -> HttpError:
    return HttpError(f"{what} than the limit of {limit} bytes (--max_message_bytes)", "RESOURCE_EXHAUSTED", 413)


def inflate(data: bytes, encoding: str, limit: int) -> bytes:
    """Undo gzip (``gzip``/``x-gzip``) or zlib (``deflate``) compression, inflating at most ``limit + 1`` bytes."""
    inflater = zlib.decompressobj(31 if "gzip" in encoding else 15)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as e:
        raise InvalidArgument(f"the request body is not valid {encoding} data: {e}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise too_large(f"the {encoding} request body inflates to more", limit)
    if not inflater.eof:
        raise InvalidArgument(f"the {encoding} request body is truncated: its compressed stream does not end")
    if inflater.unused_data:
        raise InvalidArgument(
            f"the {encoding} request body has {len(inflater.unused_data)} bytes after its compressed stream"
        )
    return out


async def offload(size: int, fn, *args):
    """``fn(*args)``, on a worker thread when ``size`` (bytes it works on) is large, so the loop keeps serving."""
    if size < OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class RestServer:
    """The aiohttp server on ``--rest_api_port``, started on the running event loop."""

    def __init__(
        self,
        core: ServingCore,
        port: int,
        address: str,
        max_body_bytes: int,
        timeout_s: float,
        drain_s: float,
        reuse_port: bool = False,
    ):
        from server import rest_tfserving, rest_v2

        self.rest = Rest(core, max_body_bytes, timeout_s)
        self.address, self.port = address, port
        app = web.Application(client_max_size=max_body_bytes)
        rest_v2.add_routes(app, self.rest)
        rest_tfserving.add_routes(app, self.rest)
        app.router.add_route("*", "/{tail:.*}", self.rest.endpoint("rest:unknown", _unknown_path))
        self.app = app
        self.drain_s = drain_s
        self.reuse_port = reuse_port  # one of several serving processes on the same port
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Bind and serve; OSError when the port cannot be bound."""
        # Bodies are decompressed by Rest.body under the size limit, never by aiohttp unbounded.
        self.runner = web.AppRunner(
            self.app, auto_decompress=False, access_log=None, handle_signals=False, shutdown_timeout=self.drain_s
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.address, self.port, reuse_port=self.reuse_port)
        try:
            await site.start()
        except OSError:
            await self.runner.cleanup()
            self.runner = None
            raise
        log.info("REST (TensorFlow Serving /v1, KServe v2 /v2) on http://%s:%d", self.address, self.port)

    async def stop(self) -> None:
        """Stop accepting, report not ready on /v2/health/ready, let in-flight calls finish (up to the drain
        time), then close the connections."""
        self.rest.draining = True
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def _unknown_path(request: web.Request, call: Call, info: RequestInfo) -> web.StreamResponse:
    error = HttpError(
        f"no such endpoint: {request.method} {request.path}; servex serves TensorFlow Serving's REST API under /v1/ "
        f"and KServe v2 under /v2/",
        "NOT_FOUND",
        404,
    )
    raise error
