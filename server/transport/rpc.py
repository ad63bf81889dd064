"""The wrapper every gRPC method of servex goes through: ServingErrors become the gRPC status they name, with
their message; anything unexpected becomes INTERNAL and is logged; every call is counted and timed (and, when it
asked for a run, added to its model version's statistics), and traced when tracing samples it."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from servex.executor.memory import MEMORY
from servex.executor.run_handler import DeadlineExceeded
from servex.loader.errors import InvalidArgument, ResourceExhausted, ServingError
from servex.server.core import REQUEST, RequestInfo, priority_from_text
from servex.server.observability import metrics
from servex.server.observability.tracing import TRACER
from servex.server.transport.reception import RECEPTION, gated

log = logging.getLogger(__name__)

UNKNOWN_MODEL_LABEL = "_unknown"


def spec_version(spec) -> int | None:
    """A TensorFlow Serving ModelSpec's version, or None when it names none (the latest)."""
    return spec.version.value if spec.HasField("version") else None


PRIORITY_METADATA = "x-servex-priority"


def request_info(context, metadata=None) -> RequestInfo:
    """The call's priority (gRPC metadata x-servex-priority, default 0) and deadline (monotonic, or None).
    ``metadata``: the call's metadata, when the caller has it (grpc.aio builds it anew at each ask: ~8 µs)."""
    priority = 0
    for key, value in context.invocation_metadata() or () if metadata is None else metadata:
        if key == PRIORITY_METADATA:
            priority = priority_from_text(value, f"metadata {PRIORITY_METADATA}")
    remaining = context.time_remaining()
    return RequestInfo(priority, (time.monotonic() + remaining) if remaining is not None else None)


_MODEL_NAME_OF: dict[type, Callable[[Any], str]] = {}


def model_name(request) -> str:
    """The model a request names, by its message type's field: TensorFlow Serving's ``model_spec`` (of its first
    task, for MultiInference), servex's ``model`` (ModelRef), KServe v2's ``model_name``; "" when it has none."""
    get = _MODEL_NAME_OF.get(type(request))
    if get is None:
        fields = request.DESCRIPTOR.fields_by_name
        if "model_spec" in fields:
            get = _model_spec_name
        elif "model" in fields:
            get = _model_ref_name
        elif "tasks" in fields:
            get = _first_task_name
        elif "model_name" in fields:
            get = _v2_model_name
        else:
            get = _no_name
        _MODEL_NAME_OF[type(request)] = get
    return get(request)


def _model_spec_name(request) -> str:
    return request.model_spec.name


def _model_ref_name(request) -> str:
    return request.model.name


def _first_task_name(request) -> str:
    return request.tasks[0].model_spec.name if request.tasks else ""


def _v2_model_name(request) -> str:
    return request.model_name


def _no_name(request) -> str:
    return ""


# A message's copies, as the memory limit counts them before it is parsed: the parsed message, and its tensors'
# bytes once decoded (gRPC's copy of the received bytes is resident already).
MESSAGE_COPIES = 2


class Malformed:
    """A request message that does not parse, or that the memory limit refuses, handed to servex's methods in its
    place (see ``lenient``); ``error`` is the ServingError they answer."""

    __slots__ = ("message", "error")

    def __init__(self, message: str, error: type[ServingError] = InvalidArgument):
        self.message = message
        self.error = error


_MODEL_NAME_OF[Malformed] = _no_name


def lenient(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler``, with a request deserializer that hands servex's methods (those marked ``parses_malformed``:
    ``rpc``'s, ModelStreamInfer) a ``Malformed`` instead of raising. A deserializer that raises makes grpcio
    answer UNKNOWN, naming a Python class, and log a traceback for every such call; the methods answer
    INVALID_ARGUMENT naming the message type, and count the call. Other handlers are returned as they are."""
    behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    parse = handler.request_deserializer
    if parse is None or not getattr(behavior, "parses_malformed", False):
        return handler
    descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
    what = descriptor.full_name if descriptor is not None else "request"

    def parse_or_say(raw: bytes):
        if MEMORY.limit:  # parsing copies the message, decoding its tensors again: admitted first
            RECEPTION.seen(len(raw))
            try:
                MEMORY.check(MESSAGE_COPIES * len(raw), "message", f"a {what} message of {len(raw)} bytes")
            except ResourceExhausted as e:
                return Malformed(e.message, ResourceExhausted)
        try:
            return parse(raw)
        except DecodeError as e:
            return Malformed(f"the request is not a valid {what} message: {e}")

    handler = handler._replace(request_deserializer=parse_or_say)
    if MEMORY.limit and handler.unary_unary is not None:  # received when it fits (server/transport/reception.py)
        handler = gated(handler, lambda message: Malformed(message, ResourceExhausted))
    return handler


def rpc(method):
    """Map ServingErrors to gRPC statuses and record the request's metrics."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self, request, context):
        start = time.perf_counter()
        model = model_name(request)
        code = "OK"
        info = RequestInfo()
        deadline = None
        try:
            if type(request) is Malformed:
                raise request.error(request.message)
            metadata = context.invocation_metadata() or ()
            info = request_info(context, metadata)
            deadline = info.deadline  # the call's own (a request parameter may shorten info's for the queue)
            if TRACER.enabled:
                info.trace = TRACER.start(name, model, lambda: metadata)
            REQUEST.set(info)
            if MEMORY.limit:  # its tensors' decoding, held until the call ends (executor/memory.py)
                size = request.ByteSize()
                info.memory = MEMORY.admit(size, "message", f"a {name} request of {size} bytes")
            answer = await method(self, request, context)
            if deadline is not None and time.monotonic() > deadline:
                # gRPC has told the client DEADLINE_EXCEEDED already; count the call so, not OK.
                raise DeadlineExceeded(f"the call's deadline passed before {name} had its answer")
            limit = getattr(self, "max_tensor_bytes", None)
            if limit is not None and (info.answer_bytes is None or info.answer_bytes > limit):
                check_answer_size(answer, limit, name)
            return answer
        except ServingError as e:
            code = e.code
            status, message = getattr(grpc.StatusCode, e.code), e.message
            if deadline is not None and time.monotonic() >= deadline:  # what the client hears (below)
                code = "DEADLINE_EXCEEDED"
        except asyncio.CancelledError:  # gRPC ended the call: its deadline passed, or the client cancelled it
            code = ended_code(deadline)
            raise
        except Exception as e:
            code = "INTERNAL"
            log.exception("%s failed", name)
            status, message = grpc.StatusCode.INTERNAL, f"internal error in {name}: {type(e).__name__}: {e}"
        finally:  # counted before the caller hears back, so a client that then reads /metrics sees its call
            if info.memory:  # admitted memory is held until the answer is sent (a client may be slow to read it)
                held, info.memory = info.memory, 0
                context.add_done_callback(lambda _context: MEMORY.release(held))
            record(self.core, name, model, info, code, start)
        if deadline is not None and time.monotonic() >= deadline:
            # gRPC ends the call at its deadline and tells the client DEADLINE_EXCEEDED itself (the client's own
            # timer fires first: the server's deadline is the client's plus the transit). A status sent now finds
            # the call ended, or about to be: grpcio leaks the failed send's operations (grpc/grpc#43360).
            raise asyncio.CancelledError
        await abort(context, status, bounded(message))

    wrapper.parses_malformed = True
    return wrapper


async def abort(context, status: grpc.StatusCode, message: str) -> None:
    """End the call with ``status``, as ``context.abort`` does. A call gRPC has ended already (its deadline passed
    at the moment servex's own timer fired, or the client went away) cannot take a status: grpcio then raises its
    ExecuteBatchError (an ``aio.InternalError``) and logs a traceback for the call, unless it has heard of the end
    by then. Raised as CancelledError instead, the call ends as one gRPC cancelled, without a log line."""
    try:
        await context.abort(status, message)
    except grpc.aio.InternalError:
        raise asyncio.CancelledError from None


# gRPC starts a server call's deadline when the call arrives, so the client's passes first, by the request's transit,
# and at its deadline the client cancels the call (RST_STREAM). On a loaded host that cancel can reach servex before
# the server's own deadline: a call ended this close to its deadline ended by it, not by its client.
DEADLINE_TRANSIT = 0.1


def ended_code(deadline: float | None) -> str:
    """The status of a call gRPC ended (its task cancelled): DEADLINE_EXCEEDED from ``DEADLINE_TRANSIT`` before its
    own ``deadline`` on, else CANCELLED (the client cancelled it or went away)."""
    if deadline is not None and time.monotonic() >= deadline - DEADLINE_TRANSIT:
        return "DEADLINE_EXCEEDED"
    return "CANCELLED"


MAX_MESSAGE_CHARS = 4096


def bounded(message: str) -> str:
    """An error message cut to ``MAX_MESSAGE_CHARS`` bytes as gRPC sends it: it travels in a trailer, and gRPC
    refuses trailers past 16 KiB, which would hide the status behind a RESOURCE_EXHAUSTED of its own (a request
    naming thousands of unknown outputs, say, gets a message listing them). gRPC percent-encodes the message:
    each byte outside printable ASCII (a non-ASCII character's UTF-8 bytes, a newline) and ``%`` take 3 bytes."""
    if len(message) <= MAX_MESSAGE_CHARS and message.isascii():  # at most 3 x 4,096 bytes once encoded
        return message
    size = 0
    for end, char in enumerate(message):
        size += 1 if " " <= char <= "~" and char != "%" else 3 * len(char.encode("utf-8", "surrogatepass"))
        if size > MAX_MESSAGE_CHARS:
            return f"{message[:end]}... ({len(message) - end} more characters)"
    return message


def check_answer_size(answer, limit: int | None, method: str) -> None:
    """RESOURCE_EXHAUSTED when ``answer`` is larger than gRPC will send (``limit``: --max_message_bytes, carried
    by the services that answer tensors as ``max_tensor_bytes``). Checked here, gRPC would fail the call after
    the handler with a logged traceback, and a stream would end. ByteSize serializes the answer (~0.1 us when
    small, as long as gRPC's own serialization when large): the wrapper skips it when the adapter set a bound
    on the answer's size (``RequestInfo.answer_bytes``, from its arrays) that is under the limit."""
    if limit is None or answer is None:
        return
    size = answer.ByteSize()
    if size > limit:
        raise ResourceExhausted(
            f"the answer to {method} is {size} bytes, more than the limit of {limit} bytes (--max_message_bytes): "
            f"ask for fewer rows or outputs, or start servex with a larger --max_message_bytes"
        )


def record(core, method: str, model: str, info: RequestInfo, code: str, start: float) -> None:
    """Count and time one answered call (any protocol); models not served share one label, so a client cannot
    grow the metrics with made-up names."""
    if info.memory:  # what its runs were admitted with (executor/memory.py)
        MEMORY.release(info.memory)
        info.memory = 0
    label = model if core.is_served(model) else UNKNOWN_MODEL_LABEL
    seconds = time.perf_counter() - start
    exemplar = None
    trace = info.trace
    if trace is not None:  # its spans go out, and its trace id marks the latency it is counted in (an exemplar)
        trace.version = info.version
        TRACER.finish(trace, method, code, start, start + seconds)
        exemplar = {"trace_id": trace.trace_id} if trace.trace_id else None
    metrics.recorder(method, label, info.version, info.signature, info.priority, code)(
        seconds, info.compute_input, info.compute_output, exemplar
    )


class _EndedCallsAtDebug(logging.Filter):
    """grpcio logs an ERROR with a traceback when it cannot send the answer of a call that ended meanwhile (its client
    went away or its deadline passed while the answer waited on the client's flow-control window), after servex's
    handler returned: such records go out at DEBUG, one line, so that clients cannot fill the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("ExecuteBatchError raised in core by servicer method"):
            log.debug("%s (the call had ended: its client went away or its deadline passed)", message)
            return False
        return True


logging.getLogger("grpc._cython.cygrpc").addFilter(_EndedCallsAtDebug())
