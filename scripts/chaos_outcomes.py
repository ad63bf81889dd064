"""How the chaos soak (scripts/chaos_soak.py) judges an answer: each fault it injects opens a *window* (its kind, when
it began, when it ended) before it strikes, and an answer that was not the one the call must get is expected only
where a fault whose window overlaps the call explains it:

- ``kill`` (a serving process killed with SIGKILL): a lost connection (``UNAVAILABLE``, ``CANCELLED``, a REST
  connection closed without an answer) of any call, and any failure of a shared-memory call (its regions were
  registered with the process that died), from the kill to ``KILL_GRACE_S`` after it (gRPC channels connect again
  after a back-off of about a second);
- ``storage`` (the checkpoint's data file of the ``tables`` model removed, truncated, unreadable or failing):
  ``INTERNAL`` naming the variable that the call's signature reads, for ``tables_read`` calls only;
- ``flood`` (many large requests at once): ``RESOURCE_EXHAUSTED`` of any call (REST's 429, or a stream's answer
  saying that memory is short), from its start to ``FLOOD_GRACE_S`` after its last answer;
- ``trickle`` (a REST client trickling its body): the 408 that client must get is expected at any time.

Everything else is unexpected. No heavy import here: tests/test_chaos_outcomes.py tests it alone.
"""

from __future__ import annotations

import math
import re
import threading
from collections import Counter
from dataclasses import dataclass, field

KILL_GRACE_S = 15.0
STORAGE_GRACE_S = 1.0
FLOOD_GRACE_S = 2.0
LOST_CONNECTION = ("UNAVAILABLE", "CANCELLED", "REST connection error")
STORAGE_ERROR = re.compile(r"INTERNAL reading (v_\d+) from the checkpoint$")
MEMORY_SHORT = re.compile(r"needs about .* of memory")  # servex's refusal when memory is short (--max_memory_bytes)
_CODE = re.compile(r"^unexpected (?:stream )?(HTTP \d+|REST connection error|[A-Z_]+\b|\w+)")


@dataclass
class Window:
    kind: str
    start: float
    end: float = math.inf  # open until the fault is undone
    detail: str = ""  # its sort: which storage fault, how large a flood

    def overlaps(self, start: float, end: float, grace: float = 0.0) -> bool:
        return self.start <= end and start <= self.end + grace


def code_of(outcome: str) -> str:
    """What came instead of the expected answer: a gRPC code's name, ``HTTP 408``, ``REST connection error``, or a
    client exception's class name."""
    if outcome.startswith("unexpected stream answer") and MEMORY_SHORT.search(outcome):
        return "RESOURCE_EXHAUSTED (in a stream)"
    match = _CODE.match(outcome)
    return match.group(1) if match else outcome[:60]


def explains(window: Window, call: str, outcome: str, start: float, end: float) -> bool:
    """Whether the fault of ``window`` explains ``outcome`` (not ``ok``) of ``call`` that ran from ``start`` to
    ``end``."""
    code = code_of(outcome)
    if window.kind == "kill":
        return window.overlaps(start, end, KILL_GRACE_S) and (code in LOST_CONNECTION or call == "v2_shared_memory")
    if window.kind == "storage":
        found = STORAGE_ERROR.search(outcome)
        return call == "tables_read" and found is not None and window.overlaps(start, end, STORAGE_GRACE_S)
    if window.kind == "flood":
        short = code.startswith("RESOURCE_EXHAUSTED") or code == "HTTP 429"
        return short and window.overlaps(start, end, FLOOD_GRACE_S)
    return False


def classify(call: str, outcome: str, start: float, end: float, windows: list[Window]) -> tuple[str, str]:
    """``("ok", "")`` for the expected answer; ``(fault kind, code)`` for a failure a fault explains (the code
    followed by the fault's sort for a storage fault: ``INTERNAL (eio)``); else ``("unexpected", "call: outcome")``."""
    if outcome == "ok":
        return "ok", ""
    if call == "rest_trickle" and outcome == "unexpected HTTP 408":  # answered, and the connection closed
        return "trickle", "HTTP 408"
    for window in reversed(windows):  # the latest first
        if explains(window, call, outcome, start, end):
            sort = f" ({window.detail})" if window.kind == "storage" and window.detail else ""
            return window.kind, code_of(outcome) + sort
    return "unexpected", f"{call}: {outcome}"


@dataclass
class Tally:
    """Every answer of a run, by kind; the fault windows, thread-safe."""

    calls: int = 0
    ok: int = 0
    expected: dict[str, Counter] = field(default_factory=dict)
    unexpected: Counter = field(default_factory=Counter)
    by_call: Counter = field(default_factory=Counter)
    windows: list[Window] = field(default_factory=list)
    injected: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def open(self, kind: str, start: float, detail: str = "") -> Window:
        """A fault of ``kind`` (``detail``: its sort, as counted in ``injected``) about to strike."""
        window = Window(kind, start, detail=detail)
        with self.lock:
            self.windows.append(window)
            self.injected[f"{kind}:{detail}" if detail else kind] += 1
        return window

    def close(self, window: Window, end: float) -> None:
        with self.lock:
            window.end = end

    def record(self, call: str, outcome: str, start: float, end: float) -> str:
        with self.lock:
            kind, what = classify(call, outcome, start, end, self.windows)
            self.calls += 1
            self.by_call[call] += 1
            if kind == "ok":
                self.ok += 1
            elif kind == "unexpected":
                self.unexpected[what[:300]] += 1
            else:
                self.expected.setdefault(kind, Counter())[what] += 1
            self.windows[:] = [w for w in self.windows if w.end + KILL_GRACE_S + 60 > start]  # older ones done
        return kind

    def note(self, what: str) -> None:
        """Something seen that is neither right nor wrong (how servex met a slow client, say)."""
        with self.lock:
            self.notes[what] += 1

    def fail(self, what: str) -> None:
        """Something a fault's check found wrong (not a call's answer)."""
        with self.lock:
            self.unexpected[what[:300]] += 1

    def unexpected_count(self) -> int:
        with self.lock:
            return sum(self.unexpected.values())

    def summary(self) -> dict:
        with self.lock:
            return {
                "calls": self.calls,
                "answered_as_expected": self.ok,
                "expected_errors": {k: dict(v.most_common()) for k, v in sorted(self.expected.items())},
                "unexpected": sum(self.unexpected.values()),
                "unexpected_examples": dict(self.unexpected.most_common(20)),
                "faults_injected": dict(sorted(self.injected.items())),
                "calls_by_kind": dict(self.by_call.most_common()),
                "notes": dict(sorted(self.notes.items())),
            }
