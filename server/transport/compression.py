"""Compressed REST answers: deflate or gzip, as the request's ``Accept-Encoding`` allows (q-values honoured), for
answers of ``COMPRESS_MIN_BYTES`` or more, as Triton does for tritonclient's ``response_compression_algorithm``."""

from __future__ import annotations

from aiohttp import web
from aiohttp.web import ContentCoding

# Smaller answers go as they are: compressing them costs more time than it saves bytes.
COMPRESS_MIN_BYTES = 1024


def answer_coding(request: web.Request) -> ContentCoding | None:
    """The coding to compress an answer with, as the request's ``Accept-Encoding`` allows (RFC 9110 12.5.3): deflate
    or gzip (``x-gzip`` too), the one with the higher q-value, deflate on a tie; none when neither is listed or both
    have ``q=0``."""
    best: tuple[float, ContentCoding] | None = None
    for item in request.headers.get("Accept-Encoding", "").lower().split(","):
        name, *params = (part.strip() for part in item.split(";"))
        coding = {"deflate": ContentCoding.deflate, "gzip": ContentCoding.gzip, "x-gzip": ContentCoding.gzip}.get(name)
        if coding is None:
            continue
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0  # not a q-value: not acceptable
        if q > 0 and (best is None or q > best[0] or (q == best[0] and coding is ContentCoding.deflate)):
            best = (q, coding)
    return best[1] if best else None


def accepts_compression(request: web.Request) -> bool:
    return answer_coding(request) is not None


def compressed(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """A whole-body response, compressed (deflate or gzip, as ``answer_coding`` picks from the request's
    Accept-Encoding) when its body is large enough; aiohttp compresses large bodies off the event loop. Streamed
    answers (already sent) go as they are."""
    body = response.body if isinstance(response, web.Response) else None
    if isinstance(body, bytes | bytearray) and len(body) >= COMPRESS_MIN_BYTES:
        coding = answer_coding(request)
        if coding is not None:
            response.enable_compression(coding)
    return response
