"""MemoryBudget: the memory a serving process may use, and the work admitted against it.

A process that allocates past its cgroup's limit is killed by the kernel, with every call it was serving. servex
admits work by an estimate of what the work will still allocate, against what the process holds now:

    resident memory now + what admitted work may still allocate + what this work will allocate <= usable

``usable`` is the limit less a margin (a tenth, at least 64 MiB: TensorFlow's and Python's allocators, the
kernel's own). Work that would pass it is refused with RESOURCE_EXHAUSTED at once, naming the limit, and frees what
it held; nothing waits for memory (a waiting request would keep holding its message). What is estimated:

- a gRPC request's message, before it is parsed (``check``: its parse and its tensors' decoding), then its size,
  held until the call ends; a REST body, from its Content-Length before it is read (JSON: what its numbers become);
- a run (``run_need``): its input tensors once more (a batch's concatenation or padding, the copy TensorFlow
  may make) and its outputs ``OUTPUT_COPIES`` times, learned per client graph as bytes per input row (the largest
  seen; until a first run is seen, the inputs' size or the signature's declared output shapes, the larger); held
  until the call ends;
- a client graph's build (``BUILD_BYTES_PER_OP`` for each op of the model's graph) and a lazy restore (the
  variables' own sizes, from the checkpoint's index), held while they happen.

The limit: ``--max_memory_bytes``, else the cgroup's (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), shared
equally by ``--serving_processes``; none (0): everything is admitted and nothing is read. Resident memory is read
from ``/proc/self/statm`` (a few microseconds), at most every ``RSS_REFRESH_SECONDS`` for small work.

gRPC reads a unary call's message only once it fits (server/transport/reception.py); what a call was admitted with
is held until its answer is sent.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable

from prometheus_client import Counter, Gauge

from servex.loader.errors import ResourceExhausted

__all__ = ["MEMORY", "MemoryBudget", "size_text"]

MIN_MARGIN = 64 * 1024 * 1024
SMALL_BYTES = 1024 * 1024  # work this small reads a resident size at most RSS_REFRESH_SECONDS old
RSS_REFRESH_SECONDS = 0.005
BUILD_BYTES_PER_OP = 4096
# A run's outputs, as admission counts them: TensorFlow's arrays, the encoded tensors, the serialized answer.
OUTPUT_COPIES = 3
MAX_LEARNED = 4096  # client graphs whose output size is remembered

LIMIT = Gauge(
    "servex_memory_limit_bytes",
    "The memory this serving process admits work against (--max_memory_bytes or its share of the cgroup's limit; "
    "0: none)",
    multiprocess_mode="livesum",
)
ADMITTED = Gauge(
    "servex_memory_admitted_bytes",
    "What admitted work (runs, builds, restores) may still allocate, by the estimates admission used",
    multiprocess_mode="livesum",
)
REFUSED = Counter(
    "servex_memory_refused_total",
    "Work refused RESOURCE_EXHAUSTED because it would pass the memory limit, by what it was",
    ["what"],
)


def size_text(nbytes: float) -> str:
    """``nbytes`` for a message: bytes, KiB, MiB or GiB."""
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "bytes" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


class MemoryBudget:
    def __init__(self):
        self.limit = 0
        self.source = ""
        self.usable = 0
        self._reserved = 0
        self._lock = threading.Lock()
        self._rss = 0
        self._rss_at = -1.0
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._statm: int | None = None
        self._pid = 0
        self._per_row: dict[Hashable, float] = {}

    def configure(self, limit: int, source: str) -> None:
        """Admit against ``limit`` bytes (0: no limit); ``source`` says where it comes from, for the refusals."""
        self.limit = max(0, int(limit))
        self.source = source
        self.usable = max(0, self.limit - max(self.limit // 10, MIN_MARGIN)) if self.limit else 0
        LIMIT.set(self.limit)

    @property
    def reserved(self) -> int:
        return self._reserved

    def resident(self) -> int:
        """This process's resident memory now, in bytes, less the file pages it shares (its libraries' code, which
        the kernel can drop and read again): what its cgroup cannot take back."""
        if self._statm is None or self._pid != os.getpid():  # opened once per process (/proc/self is resolved then)
            self._statm, self._pid = os.open("/proc/self/statm", os.O_RDONLY), os.getpid()
        fields = os.pread(self._statm, 128, 0).split()
        return (int(fields[1]) - int(fields[2])) * self._page

    # -- admission -------------------------------------------------------------------------------------

    def admit(self, need: int, what: str, detail: str = "") -> int:
        """Reserve ``need`` bytes for work of kind ``what`` (a metric label: message, run, build, restore), to be
        given back with ``release``; returns what was reserved (0 without a limit). RESOURCE_EXHAUSTED when it
        would pass the limit; ``detail`` says what the work is, in the message."""
        if not self.limit or need <= 0:
            return 0
        with self._lock:
            now = time.monotonic()
            if need >= SMALL_BYTES or now - self._rss_at > RSS_REFRESH_SECONDS:
                self._rss, self._rss_at = self.resident(), now
            held = self._rss + self._reserved
            if held + need > self.usable:
                REFUSED.labels(what).inc()
                raise ResourceExhausted(
                    f"{detail or what} needs about {size_text(need)} of memory, and this server holds "
                    f"{size_text(self._rss)} with {size_text(self._reserved)} more admitted: together over the "
                    f"{size_text(self.usable)} it may use (the memory limit of {size_text(self.limit)}, from "
                    f"{self.source}, less a margin); try again later"
                )
            self._reserved += need
            ADMITTED.set(self._reserved)
        return need

    def room(self) -> int:
        """The bytes still free to admit: usable, less resident memory (at most RSS_REFRESH_SECONDS old) and what
        admitted work may still allocate (without a limit: as good as endless)."""
        if not self.limit:
            return 1 << 62
        with self._lock:
            now = time.monotonic()
            if now - self._rss_at > RSS_REFRESH_SECONDS:
                self._rss, self._rss_at = self.resident(), now
            return self.usable - self._rss - self._reserved

    def release(self, reserved: int) -> None:
        if reserved:
            with self._lock:
                self._reserved -= reserved
                ADMITTED.set(self._reserved)

    def check(self, need: int, what: str, detail: str = "") -> None:
        """RESOURCE_EXHAUSTED when ``need`` bytes could not be admitted now; nothing is reserved (for work that is
        resident as soon as it is done, as a message's parse)."""
        if self.limit and need > 0:
            self.release(self.admit(need, what, detail))

    # -- runs ------------------------------------------------------------------------------------------

    def run_need(self, graph: Hashable, values: Iterable, declared: Callable[[], float] | None = None) -> int:
        """What a run of client graph ``graph`` (any hashable key) with these input arrays will allocate: the
        inputs once more and its outputs ``OUTPUT_COPIES`` times (learned per input row; until a run is seen, as
        large as the inputs, or as ``declared()`` bytes per row says when that is more)."""
        nbytes = rows = 0
        for value in values:
            nbytes += value.nbytes
            if not rows:
                rows = value.shape[0] if value.ndim else 1
        per_row = self._per_row.get(graph)
        if per_row is None:
            outputs = max(nbytes, declared() * max(rows, 1) if declared is not None else 0)
        else:
            outputs = per_row * max(rows, 1)
        return int(nbytes + OUTPUT_COPIES * outputs)

    def learn(self, graph: Hashable, feeds: Iterable, outputs: Iterable) -> None:
        """Remember the output bytes per input row of ``graph``'s run (the largest seen)."""
        if not self.limit:
            return
        rows = next((v.shape[0] if v.ndim else 1 for v in feeds), 1) or 1
        per_row = sum(getattr(v, "nbytes", 0) for v in outputs) / rows
        known = self._per_row.get(graph)
        if known is None or per_row > known:
            if len(self._per_row) >= MAX_LEARNED:
                self._per_row.clear()
            self._per_row[graph] = per_row


MEMORY = MemoryBudget()  # the process's one budget (configured by server/app.py)
