"""server/transport/rpc.py: error messages bounded as gRPC sends them (percent-encoded), and requests that do not parse
handed to servex's methods instead of failing inside grpcio; a status for a call gRPC has ended dropped quietly."""

from __future__ import annotations

import asyncio
import time
import urllib.parse

import grpc
import pytest
from tensorflow_serving.apis import predict_pb2

from servex.server.transport.rpc import (
    DEADLINE_TRANSIT,
    MAX_MESSAGE_CHARS,
    Malformed,
    abort,
    bounded,
    ended_code,
    lenient,
)


def encoded(message: str) -> int:
    """Bytes of ``message`` as gRPC's grpc-message trailer carries it (percent-encoding outside printable ASCII)."""
    return len(urllib.parse.quote(message, safe="".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")))


@pytest.mark.parametrize(
    "message",
    ["short", "x" * MAX_MESSAGE_CHARS, "x" * 10_000, "模" * 2000, "model '模型' is not served", "a\nb%" * 3000],
    ids=["short", "at-the-limit", "long-ascii", "cjk", "short-cjk", "newlines-and-percent"],
)
def test_a_message_is_cut_to_the_limit_as_grpc_encodes_it(message):
    cut = bounded(message)
    assert encoded(cut) <= MAX_MESSAGE_CHARS + 40  # the "... (N more characters)" note
    if encoded(message) <= MAX_MESSAGE_CHARS:
        assert cut == message
    else:
        kept = cut.rsplit("... (", 1)[0]
        assert message.startswith(kept) and cut.endswith(f"({len(message) - len(kept)} more characters)")
        assert encoded(kept) > MAX_MESSAGE_CHARS - 9  # cut no earlier than it must be


def test_lenient_parsing_hands_servex_methods_a_malformed_request():
    async def method(request, context):
        return request

    method.parses_malformed = True
    handler = lenient(
        grpc.unary_unary_rpc_method_handler(method, request_deserializer=predict_pb2.PredictRequest.FromString)
    )
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "m"
    assert handler.request_deserializer(request.SerializeToString()) == request
    bad = handler.request_deserializer(b"\xff\xff\xff\xff")
    assert isinstance(bad, Malformed)
    assert bad.message.startswith("the request is not a valid tensorflow.serving.PredictRequest message: ")


def test_lenient_leaves_other_handlers_as_they_are():
    async def method(request, context):  # not servex's: grpcio's own handling stays
        return request

    handler = grpc.unary_unary_rpc_method_handler(method, request_deserializer=predict_pb2.PredictRequest.FromString)
    assert lenient(handler) is handler


class _EndedCall:
    """A servicer context whose call gRPC has ended: sending its status fails as grpcio's does (ExecuteBatchError,
    an aio.InternalError), which grpcio logs with a traceback when it propagates."""

    async def abort(self, code, details):
        raise grpc.aio.InternalError('Failed "execute_batch"')


class _LiveCall:
    async def abort(self, code, details):
        raise grpc.aio.AbortError(f"{code}: {details}")


def test_a_status_for_a_call_grpc_has_ended_ends_it_as_cancelled():
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(abort(_EndedCall(), grpc.StatusCode.DEADLINE_EXCEEDED, "waited too long"))
    with pytest.raises(grpc.aio.AbortError):  # a live call is aborted as by context.abort
        asyncio.run(abort(_LiveCall(), grpc.StatusCode.INVALID_ARGUMENT, "bad input"))


def test_a_call_ended_just_before_its_server_deadline_counts_as_deadline_exceeded():
    # The client's deadline passes first (by the request's transit) and its cancel may arrive before the server's.
    now = time.monotonic()
    assert ended_code(now + DEADLINE_TRANSIT / 2) == "DEADLINE_EXCEEDED"
    assert ended_code(now - 1.0) == "DEADLINE_EXCEEDED"
    assert ended_code(now + 10 * DEADLINE_TRANSIT + 1.0) == "CANCELLED"  # the client cancelled it well before
    assert ended_code(None) == "CANCELLED"
