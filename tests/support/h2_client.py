"""A gRPC client that never reads its answer, on a raw socket with a hand-written minimum of HTTP/2 (RFC 9113):
the connection preface, a SETTINGS frame with a small INITIAL_WINDOW_SIZE, each call as HEADERS (HPACK literal
fields without indexing, RFC 7541 6.2.2) and one DATA frame, and then no WINDOW_UPDATE ever: the server may send
a stream's answer only as far as that window, and holds the rest.

``frames`` looks at what the server did send, frame by frame (type, flags, stream, payload), without decoding
HPACK beyond finding a literal ``grpc-status`` in trailers. Reading the socket grants the server nothing more (no
window): it only lets the test see the frames, and, with ``answer_pings``, acknowledge the server's pings as a
client that read for a while and then stopped reading would have.
"""

from __future__ import annotations

import re
import socket
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
ENABLE_PUSH, INITIAL_WINDOW_SIZE = 0x2, 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _integer(value: int) -> bytes:
    """An HPACK integer with a 7-bit prefix (RFC 7541 5.1), the string-length form (Huffman bit clear)."""
    if value < 127:
        return bytes([value])
    out, value = [127], value - 127
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes([*out, value])


def _literal(name: str, value: str) -> bytes:
    """A header field as an HPACK literal without indexing, new name, no Huffman coding."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _integer(len(n)) + n + _integer(len(v)) + v


def grpc_call_frames(stream: int, method: str, message: bytes, authority: str, timeout_s: int | None) -> bytes:
    """One unary gRPC call's HEADERS and DATA frames on ``stream``: ``message`` (a serialized request) framed as
    gRPC frames it (uncompressed, 5-byte prefix); with ``timeout_s``, a grpc-timeout of that many seconds."""
    fields = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", authority),
              ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip
    if timeout_s is not None:
        fields.append(("grpc-timeout", f"{timeout_s}S"))
    block = b"".join(_literal(k, v) for k, v in fields)
    body = b"\x00" + struct.pack(">I", len(message)) + message
    return frame(HEADERS, END_HEADERS, stream, block) + frame(DATA, END_STREAM, stream, body)


class NeverReader:
    """One connection to ``address`` ("host:port") that grants each stream ``window`` bytes, makes ``calls`` calls
    of ``method`` with ``message`` (streams 1, 3, 5, ...; ``timeout_s``: their grpc-timeout) and never grants more.

    The server's SETTINGS are acknowledged without reading them (they come first, whatever they say), as a client
    that read them and then stopped reading would have: the server drops a connection that never acknowledges
    them. ``seen`` keeps every frame ``frames`` returned; ``closed``: the server closed the connection."""

    def __init__(self, address: str, method: str, message: bytes, window: int = 0, calls: int = 1,
                 timeout_s: int | None = None):  # fmt: skip
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        settings = struct.pack(">HI", ENABLE_PUSH, 0) + struct.pack(">HI", INITIAL_WINDOW_SIZE, window)
        out = PREFACE + frame(SETTINGS, 0, 0, settings) + frame(SETTINGS, ACK, 0)
        for i in range(calls):
            out += grpc_call_frames(2 * i + 1, method, message, address, timeout_s)
        self.sock.sendall(out)
        self._buffer = bytearray()
        self.seen: list[tuple[int, int, int, bytes]] = []
        self.closed = False

    def frames(self, wait_s: float = 0.2, answer_pings: bool = False) -> list[tuple[int, int, int, bytes]]:
        """The frames (type, flags, stream, payload) the server sent since the last look: read until nothing more
        comes for ``wait_s`` seconds or the server closes. With ``answer_pings``, each PING is acknowledged."""
        self.sock.settimeout(wait_s)
        try:
            while not self.closed:
                chunk = self.sock.recv(1 << 16)
                self._buffer += chunk
                self.closed = not chunk
        except TimeoutError:
            pass
        except OSError:  # reset
            self.closed = True
        out, at, data = [], 0, self._buffer
        while at + 9 <= len(data):
            length = int.from_bytes(data[at : at + 3], "big")
            if at + 9 + length > len(data):
                break
            kind, flags = data[at + 3], data[at + 4]
            stream = int.from_bytes(data[at + 5 : at + 9], "big") & 0x7FFFFFFF
            out.append((kind, flags, stream, bytes(data[at + 9 : at + 9 + length])))
            at += 9 + length
        del self._buffer[:at]
        self.seen += out
        pings = [frame(PING, ACK, 0, p) for k, f, _, p in out if k == PING and not f & ACK]
        if answer_pings and pings and not self.closed:
            self.sock.sendall(b"".join(pings))
        return out

    def data_bytes(self, stream: int = 1) -> int:
        """The bytes of answer (DATA payload) the server has sent on ``stream`` so far, as ``seen``."""
        return sum(len(p) for kind, _, s, p in self.seen if kind == DATA and s == stream)

    def ended(self, stream: int = 1) -> bool:
        """Whether the server ended ``stream``, as ``seen``: trailers (HEADERS with END_STREAM) or RST_STREAM."""
        return any(s == stream and (k == RST_STREAM or k == HEADERS and f & END_STREAM) for k, f, s, _ in self.seen)

    def status(self, stream: int = 1) -> int | None:
        """The grpc-status of ``stream``'s trailers, as ``seen``, where the server wrote it as a plain literal."""
        for kind, flags, s, payload in self.seen:
            if s == stream and kind == HEADERS and flags & END_STREAM:
                found = re.search(rb"grpc-status([\x01-\x03])", payload)
                if found:
                    at = found.end()
                    return int(payload[at : at + found.group(1)[0]])
        return None

    def close(self) -> None:
        """Close the connection abruptly (TCP RST, as a client that crashed or was killed)."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
