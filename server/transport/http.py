"""servex's REST port (``--rest_api_port``): an aiohttp server on the gRPC server's event loop that serves
TensorFlow Serving's REST API (``/v1/...``, server/protocols/tfserving/rest_api.py) and KServe v2 REST (``/v2/...``,
server/protocols/kserve/rest_api.py).

This module owns what every REST call shares: the HTTP status of each error (TensorFlow Serving's mapping of
gRPC codes, below), the ``{"error": "..."}`` body, request metrics (the same ``servex_requests_total`` and
latency histogram as gRPC, methods ``rest:*``), the call's priority (header ``x-servex-priority``, as the gRPC
metadata) and deadline (``--rest_api_timeout_in_ms``, TensorFlow Serving's flag), and reading the body: at
most ``--max_message_bytes`` on the wire and again after ``Content-Encoding: gzip``/``deflate`` is undone, so
that a compressed bomb is answered 413 having inflated no more than the limit. A JSON document (a ``/v1``
body, the JSON part of a ``/v2`` body) may have at most a quarter of that limit (``JSON_SHARE``): parsed, JSON
takes many times its size in memory. Answers of 1 KiB or more are compressed when the request's ``Accept-Encoding``
allows it (server/transport/compression.py).

Clients that go away mid-call are counted CANCELLED (499), not logged as errors; malformed HTTP that aiohttp
answers 400 itself is logged at DEBUG, so that no client can fill the log at ERROR.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np
import orjson
from aiohttp import http_exceptions, web

from servex.executor.memory import MEMORY
from servex.executor.run_handler import DeadlineExceeded
from servex.loader.errors import InvalidArgument, ResourceExhausted, ServingError
from servex.server.core import REQUEST, RequestInfo, ServingCore, priority_from_text
from servex.server.observability.tracing import TRACER
from servex.server.transport import tensors
from servex.server.transport.compression import compressed
from servex.server.transport.rpc import PRIORITY_METADATA, record

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
# A JSON document may have at most 1/JSON_SHARE of --max_message_bytes (decompressed): parsed, each number is a
# Python object and a list entry, then an array or two and the answer: about 16 times the text at worst.
JSON_SHARE = 4
JSON_LIMIT_REASON = (
    "a quarter of --max_message_bytes, for JSON: parsed, JSON takes many times its size in memory; send large "
    "tensors in binary (the v2 binary tensor extension, or gRPC)"
)
# An object (string) array with more elements than this counts as large without summing its strings' lengths.
OBJECT_ELEMENTS_LARGE = 1024


# A JSON body's bytes as the memory limit counts them once decoded: the body, its numbers as Python objects (about
# 32 bytes for each few characters), and the arrays made from them.
JSON_COPIES = 6


CLOSE_AFTER_S = 1.0  # an answer that ends its connection: how long the client's late bytes are still read


class HttpError(ServingError):
    """A ServingError answered with its own HTTP status (413 for a body over the limit, 415 for an unknown
    Content-Encoding, 405 for a method an endpoint does not take, with its ``Allow`` header) while its gRPC code
    names it in metrics."""

    def __init__(self, message: str, code: str, status: int, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.code = code
        self.status = status
        self.headers = headers


class Cancelled(ServingError):
    """The client went away before the call was answered (TensorFlow Serving's 499)."""

    code = "CANCELLED"


def status_of(error: ServingError) -> int:
    return getattr(error, "status", None) or HTTP_STATUS.get(error.code, 500)


def error_response(error: ServingError) -> web.Response:
    headers = getattr(error, "headers", None)
    response = web.Response(body=orjson.dumps({"error": error.message}), status=status_of(error), content_type=JSON,
                            headers=headers)  # fmt: skip
    if headers and headers.get("Connection") == "close":
        response.force_close()  # no lingering read of what the client has yet to send
    return response


def json_response(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type=JSON)


def payload_bytes(arrays) -> int:
    """About how many bytes ``arrays`` (outputs) hold, to choose where to encode them: ``nbytes``, but for object
    (string) arrays, whose ``nbytes`` counts pointers only, the strings' lengths; an object array of many
    elements counts as large (``OFFLOAD_BYTES``) without summing them."""
    total = 0
    for array in arrays:
        if not isinstance(array, np.ndarray):
            array = np.asarray(array, dtype=object if isinstance(array, bytes | str) else None)
        if array.dtype.kind != "O":
            total += array.nbytes
        elif array.size > OBJECT_ELEMENTS_LARGE:
            total += OFFLOAD_BYTES
        else:
            total += sum(len(v) if isinstance(v, bytes | str) else 8 for v in array.flat)
    return total


@dataclass
class Call:
    """What a handler tells the wrapper about the call, for metrics: its method and model."""

    method: str
    model: str = ""


Handler = Callable[[web.Request, Call, RequestInfo], Awaitable[web.StreamResponse]]


def model_in_path(request: web.Request) -> str:
    """The model a TensorFlow Serving REST URL names (``/v1/models/NAME[/versions/N|/labels/L][:verb]``), or ""."""
    parts = request.rel_url.raw_path.split("/", 4)
    return parts[3].split(":", 1)[0] if len(parts) > 3 and parts[2] == "models" else ""


class Rest:
    """Shared state of the REST adapters: the core, the limits, and whether the server is draining."""

    def __init__(self, core: ServingCore, max_body_bytes: int, timeout_s: float, body_timeout_s: float = 30.0):
        self.core = core
        self.max_body_bytes = max_body_bytes
        self.max_json_bytes = max_body_bytes // JSON_SHARE
        self.timeout_s = timeout_s
        self.body_timeout_s = body_timeout_s  # a body not all in by then: 408, and the connection closed
        self.draining = False

    def endpoint(
        self, method: str, handler: Handler, bounded: bool = True
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """An aiohttp handler around ``handler``: errors become ``{"error": ...}`` with their HTTP status,
        and the call is counted and timed like a gRPC call. ``bounded``: the call gets --rest_api_timeout_in_ms
        (not a model repository load, which answers when the model serves)."""

        async def handle(request: web.Request) -> web.StreamResponse:
            start = time.perf_counter()
            call = Call(method, request.match_info.get("name", ""))
            code = "OK"
            info = RequestInfo()
            try:
                info = self.request_info(request)
                if TRACER.enabled:
                    info.trace = TRACER.start(method, call.model or model_in_path(request), request.headers.items)
                REQUEST.set(info)
                if info.deadline is None or not bounded:
                    return compressed(request, await handler(request, call, info))
                # The whole call is bounded, as TensorFlow Serving bounds its run with RunOptions.timeout_in_ms: a
                # run that started goes on on its worker (TensorFlow's runs cannot be stopped from Python), and its
                # answer is dropped.
                async with asyncio.timeout_at(info.deadline) as guard:  # the loop's clock is time.monotonic
                    try:
                        answer = await handler(request, call, info)
                    except asyncio.CancelledError:
                        if guard.expired():
                            raise DeadlineExceeded(
                                f"no answer within --rest_api_timeout_in_ms ({self.timeout_s * 1000:.0f} ms); a "
                                f"run that had started finishes on its worker and its answer is dropped"
                            ) from None
                        raise
                return compressed(request, answer)
            except ServingError as e:
                code = e.code
                response = error_response(e)
                if isinstance(e, HttpError) and e.headers and e.headers.get("Connection") == "close":
                    await _send_then_close(request, response)
                return response
            except RecursionError:  # JSON lists nested deeper than the codec walks
                error = InvalidArgument(
                    f"the request's JSON is nested too deeply: a tensor has at most {tensors.MAX_DIMS} dimensions "
                    f"(nested lists)"
                )
                code = error.code
                return error_response(error)
            except ConnectionError as e:  # the client went away (mid-body, or while the answer was sent)
                code = Cancelled.code
                log.debug("%s: the client went away: %s: %s", call.method, type(e).__name__, e)
                return error_response(Cancelled(f"the client went away: {e}"))
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

    async def body(self, request: web.Request, json: bool = False) -> bytes:
        """The request body, decompressed per Content-Encoding; 413 beyond ``max_body_bytes`` before or after, or
        with ``json`` (a body that is all JSON) beyond ``max_json_bytes``. A client that goes away mid-body is
        CANCELLED."""
        limit, reason = (self.max_json_bytes, JSON_LIMIT_REASON) if json else (self.max_body_bytes, BODY_LIMIT_REASON)
        if request.content_length is not None and request.content_length > limit:
            raise too_large(f"the request body has {request.content_length} bytes, more than", limit, reason)
        info = REQUEST.get(None)
        if MEMORY.limit and request.content_length and info is not None:  # admitted before it is read
            size = request.content_length
            try:  # the body, and what decoding makes of it (JSON's numbers as Python objects, then arrays)
                info.memory += MEMORY.admit(size * (JSON_COPIES if json else 2), "message", f"a body of {size} bytes")
            except ResourceExhausted as e:  # not read: the connection cannot go on
                raise HttpError(e.message, e.code, 429, {"Connection": "close"}) from None
        try:
            if self.body_timeout_s > 0:
                async with asyncio.timeout(self.body_timeout_s):
                    data = await request.read()
            else:
                data = await request.read()
        except TimeoutError:  # a client trickling its body holds a connection and its buffer: it is dropped
            raise HttpError(
                f"the request body was not all received within {self.body_timeout_s * 1000:.0f} ms "
                f"(--rest_api_body_timeout_in_ms); the connection is closed",
                "DEADLINE_EXCEEDED",
                408,
                {"Connection": "close"},
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise too_large("the request body is larger than", self.max_body_bytes, BODY_LIMIT_REASON) from None
        except ConnectionError as e:
            raise Cancelled(f"the client went away while sending the request body: {e}") from None
        except http_exceptions.HttpProcessingError as e:  # e.g. a body shorter than its Content-Length
            raise InvalidArgument(f"the request body is malformed HTTP: {e.message}") from None
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            if len(data) > limit:  # a chunked body, without Content-Length
                raise too_large(f"the request body has {len(data)} bytes, more than", limit, reason)
            return data
        if encoding not in ("gzip", "x-gzip", "deflate"):
            raise HttpError(
                f"Content-Encoding {encoding!r} is not supported: send gzip, deflate or an uncompressed body",
                "INVALID_ARGUMENT",
                415,
            )
        # Off the loop whatever the compressed size: a small body may inflate to the whole limit.
        return await asyncio.get_running_loop().run_in_executor(
            tensors.REQUEST_WORK, inflate, data, encoding, limit, reason
        )

    def check_json_size(self, size: int) -> None:
        """413 for a JSON document (the JSON part of a v2 body) over ``max_json_bytes``."""
        if size > self.max_json_bytes:
            raise too_large(f"the request's JSON has {size} bytes, more than", self.max_json_bytes, JSON_LIMIT_REASON)


BODY_LIMIT_REASON = "--max_message_bytes"


def too_large(what: str, limit: int, reason: str = BODY_LIMIT_REASON) -> HttpError:
    """413: ``what`` ends with "more than" or "larger than"."""
    return HttpError(f"{what} the limit of {limit} bytes ({reason})", "RESOURCE_EXHAUSTED", 413)


def inflate(data: bytes, encoding: str, limit: int, reason: str = BODY_LIMIT_REASON) -> bytes:
    """Undo gzip (``gzip``/``x-gzip``) or zlib (``deflate``) compression, inflating at most ``limit + 1`` bytes."""
    inflater = zlib.decompressobj(31 if "gzip" in encoding else 15)
    try:
        out = inflater.decompress(data, limit + 1)
    except zlib.error as e:
        raise InvalidArgument(f"the request body is not valid {encoding} data: {e}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise too_large(f"the {encoding} request body inflates to more than", limit, reason)
    if not inflater.eof:
        raise InvalidArgument(f"the {encoding} request body is truncated: its compressed stream does not end")
    if inflater.unused_data:
        raise InvalidArgument(
            f"the {encoding} request body has {len(inflater.unused_data)} bytes after its compressed stream"
        )
    return out


async def offload(size: int, fn, *args, threshold: int = OFFLOAD_BYTES):
    """``fn(*args)``, on a worker thread (the requests' pool, ``tensors.REQUEST_WORK``) when ``size`` (bytes it
    works on) is ``threshold`` or more, so the loop keeps serving."""
    return await tensors.off_loop(size, fn, *args, threshold=threshold)


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
        prometheus_path: str = "",
        cors: bool = False,
        batching: bool = False,
        routes: Sequence[Callable[[web.Application, Rest], None]] = (),
        body_timeout_s: float = 30.0,
    ):
        """``routes``: each protocol's ``add_routes(app, rest)``, in the order their paths are matched."""
        self.rest = Rest(core, max_body_bytes, timeout_s, body_timeout_s)
        self.address, self.port = address, port
        app = web.Application(client_max_size=max_body_bytes)
        # First, so that no API route (/v1's take every method) answers these paths or methods instead.
        if prometheus_path:  # TensorFlow Serving's --monitoring_config_file
            app.router.add_get(prometheus_path, functools.partial(_prometheus, batching=batching))
        if cors:  # TensorFlow Serving's --rest_api_enable_cors_support
            app.router.add_route("OPTIONS", "/{tail:.*}", _preflight)
            app.on_response_prepare.append(_allow_any_origin)
        for add_routes in routes:
            add_routes(app, self.rest)
        app.router.add_route("*", "/{tail:.*}", self.rest.endpoint("rest:unknown", _unknown_path))
        self.app = app
        self.drain_s = drain_s
        self.reuse_port = reuse_port  # one of several serving processes on the same port
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Bind and serve; OSError when the port cannot be bound."""
        # Bodies are decompressed by Rest.body under the size limit, never by aiohttp unbounded.
        self.runner = web.AppRunner(
            self.app,
            auto_decompress=False,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=self.drain_s,
            logger=_http_log,
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


CORS_METHODS = "GET, POST, OPTIONS"


async def _preflight(request: web.Request) -> web.Response:
    """A CORS preflight: any origin may call with the methods and headers it asks for."""
    asked = request.headers.get("Access-Control-Request-Headers", "Content-Type")
    headers = {"Access-Control-Allow-Methods": CORS_METHODS, "Access-Control-Allow-Headers": asked}
    return web.Response(status=204, headers=headers)


async def _allow_any_origin(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Access-Control-Allow-Origin"] = "*"


async def _prometheus(request: web.Request, batching: bool = False) -> web.Response:
    """The metrics, as on --metrics_port, and TensorFlow Serving's metrics under its names (generated off the event
    loop: a scrape walks every series); ``batching``: servex's --enable_batching (TensorFlow Serving's batching
    metrics only then)."""
    from servex.server.observability.metrics import exposition

    loop = asyncio.get_running_loop()
    accept = request.headers.get("Accept", "")
    body, content_type = await loop.run_in_executor(tensors.REQUEST_WORK, exposition, True, batching, accept)
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _unknown_path(request: web.Request, call: Call, info: RequestInfo) -> web.StreamResponse:
    """404, or 405 with ``Allow`` when another endpoint has this path but takes other methods."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        methods = ", ".join(sorted(allowed))
        raise HttpError(
            f"method {request.method} is not allowed on {request.path}: it takes {methods}",
            "UNIMPLEMENTED",
            405,
            {"Allow": methods},
        )
    raise HttpError(
        f"no such endpoint: {request.method} {request.path}; servex serves TensorFlow Serving's REST API under /v1/ "
        f"and KServe v2 under /v2/",
        "NOT_FOUND",
        404,
    )


async def _send_then_close(request: web.Request, response: web.StreamResponse) -> None:
    """Send ``response`` and end the connection: the client reads the answer, then the end of the stream at once,
    and the connection closes ``CLOSE_AFTER_S`` later, whatever the client still sends (aiohttp would otherwise go on
    reading a body left unread, a trickling client's or one refused before it was read, for up to 10 s)."""
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionError:
        return
    transport = request.transport
    if transport is not None and transport.can_write_eof():
        transport.write_eof()
    asyncio.get_running_loop().call_later(CLOSE_AFTER_S, request.protocol.force_close)


class _ClientErrorsAtDebug(logging.Filter):
    """aiohttp answers malformed HTTP (a bad chunk size, an over-long header, ...) 400 itself and logs it as an
    ERROR with a traceback: such records go out at DEBUG, one line, so that clients cannot fill the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, http_exceptions.HttpProcessingError | ConnectionError):
            _http_log.debug("%s: %s: %s", record.getMessage(), type(error).__name__, error)
            return False
        return True


# The REST server's own aiohttp logger (aiohttp's default is "aiohttp.server").
_http_log = logging.getLogger("servex.server.transport.http.http")
_http_log.addFilter(_ClientErrorsAtDebug())
