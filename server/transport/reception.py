"""Reception: with a memory limit, gRPC receives a request's message only when servex has room for it.

For a unary call, gRPC reads the whole message, and copies it into Python, before servex's handler runs: a burst of
large messages could fill the memory before admission (executor/memory.py) sees any of them. With a memory limit,
servex's unary methods are served as request-streaming ones (the same call on the wire: one message, then the
client's half-close), so that gRPC reads the message only when the handler asks for it. The handler asks at once
while the memory left holds the messages being received, each counted ``RECEPTION_COPIES`` times the largest
message seen lately (gRPC's buffer, its copy into Python, the parse, the decoded tensors); else it waits, while
gRPC's flow control holds the client to a window's worth, until there is room, the call's deadline comes or
``MAX_WAIT_SECONDS`` pass: then the call is answered RESOURCE_EXHAUSTED, unread.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from servex.executor.memory import MEMORY, REFUSED, size_text

RECEPTION_COPIES = 4
MIN_EXPECTED = 1 << 20  # a message's size until larger ones are seen
FORGET_SECONDS = 60.0  # the largest message seen counts this long after it was seen
MAX_WAIT_SECONDS = 5.0
POLL_SECONDS = (0.001, 0.02)  # the first and the longest wait between two looks at the memory


class Reception:
    def __init__(self):
        self.receiving = 0  # messages asked of gRPC and not yet parsed
        self.largest = MIN_EXPECTED
        self._largest_at = 0.0

    def seen(self, nbytes: int) -> None:
        """A message of ``nbytes`` was received."""
        now = time.monotonic()
        if nbytes >= self.largest or now - self._largest_at > FORGET_SECONDS:
            self.largest, self._largest_at = max(nbytes, MIN_EXPECTED), now

    def fits(self) -> bool:
        """Whether one more message may be received now."""
        return MEMORY.room() >= (self.receiving + 1) * RECEPTION_COPIES * self.largest

    async def wait(self, remaining: float | None) -> float:
        """Wait until one more message fits; returns the seconds waited, or raises TimeoutError after
        ``remaining`` (the call's) or MAX_WAIT_SECONDS."""
        start = time.monotonic()
        limit = MAX_WAIT_SECONDS if remaining is None else min(remaining, MAX_WAIT_SECONDS)
        pause = POLL_SECONDS[0]
        while not self.fits():
            if time.monotonic() - start + pause > limit:
                raise TimeoutError
            await asyncio.sleep(pause)
            pause = min(pause * 2, POLL_SECONDS[1])
        return time.monotonic() - start


RECEPTION = Reception()


def gated(handler: grpc.RpcMethodHandler, refused) -> grpc.RpcMethodHandler:
    """``handler`` (a unary-unary one of servex's methods) served request-streaming: the message is read once it
    fits. ``refused(message)`` makes what the method gets in place of a request when it never fits (a Malformed
    answered RESOURCE_EXHAUSTED)."""
    serve = handler.unary_unary

    async def receive_then_serve(_requests, context):
        if not RECEPTION.fits():
            try:
                await RECEPTION.wait(context.time_remaining())
            except TimeoutError:
                REFUSED.labels("message").inc()
                message = (
                    f"the request was not received: for {MAX_WAIT_SECONDS:g} s (or until the call's deadline) the "
                    f"memory left was too little for one more message of up to {size_text(RECEPTION.largest)} (the "
                    f"largest lately) while {RECEPTION.receiving} others were received (the memory limit of "
                    f"{size_text(MEMORY.limit)}, from {MEMORY.source}); try again later"
                )
                return await serve(refused(message), context)
        RECEPTION.receiving += 1
        try:
            request = await context.read()
        finally:
            RECEPTION.receiving -= 1
        if request is grpc.aio.EOF:
            request = refused("the call ended before its request message came")
        return await serve(request, context)

    return grpc.stream_unary_rpc_method_handler(
        receive_then_serve, handler.request_deserializer, handler.response_serializer
    )
