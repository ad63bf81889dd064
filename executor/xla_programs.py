"""A client graph's XLA programs (loader/xla.py), one per set of feed shapes: compiled off the requests' path,
checked, and run only on requests TensorFlow's own kernels would have served.

- **Compiled beside.** XLA compiles a program per set of input shapes, on its first run at them: 0.2 s for a GRU,
  0.5 s for a BERT-like encoder, 1.3 s for MobileNetV2 at batch 1 (5 s at 32). A run whose shapes have no program yet
  goes in the session as before, and its feeds are compiled for on the prepare pool, then run ``WARM`` more times;
  at most ``MOST`` sets of shapes per graph (a client sending every batch size compiles no more than that). Batches
  are padded to a few sizes (batching.py's ``program_rows``: ten up to 32 rows), which get theirs.
- **Checked.** The program's first answer is compared with the session's answer to the same feeds (floats within
  ``RTOL`` of the largest value, everything else equal); one that differs, or a compile that fails (an op XLA cannot
  compile, a string op), keeps those shapes in the session, and ends XLA's trial.
- **Bad input still gets TensorFlow's error.** XLA checks no index: a gather (an embedding's lookup) clamps an
  index out of range where TensorFlow on a CPU fails the run with INVALID_ARGUMENT naming it. So a request runs
  compiled only where each of its integer feeds lies within the values the session's runs of that feed have
  already answered (an index in range there, at both ends, is in range between them); anything else runs in the
  session, which answers it or names what is wrong, and widens the range when it answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from servex.loader.variables import PREPARE_POOL, RunGate

log = logging.getLogger(__name__)

# Graphs that run these are not tried: XLA's CPU convolutions ran far slower than TensorFlow's oneDNN kernels
# (MobileNetV2 84 ms a row against 17), and trying one (a compile of 1.7 s of a core beside the requests, then a slow
# run) raised MobileNetV2's mean latency over its first 5 s at 1 caller from 16.0 ms to 22.2.
CONVOLUTIONS = frozenset(
    {
        "Conv", "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput", "Conv3DBackpropInputV2",
        "DepthwiseConv2dNativeBackpropInput", "FusedConv2D", "FusedDepthwiseConv2dNative", "QuantizedConv2D",
    }
)  # fmt: skip
# A graph whose calls run a loop of these tries XLA whatever the cores its lone runs kept busy (thread_modes.py's
# XLA_BUSY): a recurrent loop of tiny ops is where XLA gains most (a GRU of 64 steps, 2.5 ms a row compiled against
# 8.6 on its run worker), and its lone runs' busy cores are TensorFlow's threads spinning between ops, which read
# 1.46 in one start and 1.80 in the next on one host.
LOOPS = frozenset({"While", "StatelessWhile"})
MOST = 12  # (program_rows' ten sizes up to 32 rows, and two more)
WARM = 2
RTOL = 1e-3


def disagreement(got: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> str | None:
    """How the program's answer differs from the session's, or None where they agree."""
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"fetch {i}: {a.dtype}{list(a.shape)} against {b.dtype}{list(b.shape)}"
        if np.issubdtype(b.dtype, np.floating):
            scale = float(np.max(np.abs(b))) if b.size else 0.0
            differs = not np.allclose(a, b, rtol=RTOL, atol=RTOL * scale, equal_nan=True)
        else:
            differs = not np.array_equal(a, b)
        if differs:
            return f"fetch {i}: its values differ"
    return None


class XlaPrograms:
    """A client graph's XLA programs and the integer feed values its session has answered."""

    def __init__(self, key: str, program: Callable[[], object], gate: RunGate, run, failed: Callable[[], None]):
        """``program``: the XLA session's callable (None until made, or once given back); ``run(fn, feeds)`` runs a
        callable; ``failed``: called when a compile fails or its answer differs."""
        self._key = key
        self._program = program
        self._gate = gate
        self._run = run
        self._failed = failed
        self._shapes: dict[tuple, bool | None] = {}  # True: compiled and checked; False: failed; None: compiling
        self._seen: dict[tuple, int] = {}  # calls of compile() per set of shapes not compiled
        self._ranges: dict[int, tuple[int, int]] = {}  # integer feed -> the least and most value answered
        self._lock = threading.Lock()

    def served(self, sorted_feeds: Sequence[np.ndarray]) -> None:
        """The session answered these feeds: its integer feeds' values are in range."""
        for i, a in enumerate(sorted_feeds):
            if a.dtype.kind in "iu" and a.size:
                lo, hi = int(a.min()), int(a.max())
                seen = self._ranges.get(i)
                if seen is None or lo < seen[0] or hi > seen[1]:
                    with self._lock:
                        seen = self._ranges.get(i, (lo, hi))
                        self._ranges[i] = (min(lo, seen[0]), max(hi, seen[1]))

    def _answered(self, sorted_feeds: Sequence[np.ndarray]) -> bool:
        for i, a in enumerate(sorted_feeds):
            if a.dtype.kind in "iu" and a.size:
                seen = self._ranges.get(i)
                if seen is None or int(a.min()) < seen[0] or int(a.max()) > seen[1]:
                    return False
        return True

    def ready(self, sorted_feeds: Sequence[np.ndarray]) -> bool:
        """Whether these feeds may run compiled: their shapes' program is checked, their integers in range."""
        return self._shapes.get(_shapes(sorted_feeds)) is True and self._answered(sorted_feeds)

    def compiling(self) -> bool:
        return None in self._shapes.values()

    def run(self, sorted_feeds: Sequence[np.ndarray]) -> list[np.ndarray] | None:
        """The program's answer, or None where the feeds may not run compiled (or the session was given back)."""
        if not self.ready(sorted_feeds):
            return None
        self._gate.enter()
        try:
            fn = self._program()
            return None if fn is None else self._run(fn, sorted_feeds)
        finally:
            self._gate.leave()

    def compile(self, sorted_feeds: Sequence[np.ndarray], expected: Sequence[np.ndarray], after: int = 1) -> None:
        """Compile for these feeds' shapes on the prepare pool (``expected``: the session's answer to them), on the
        ``after``-th call with them, unless compiled or tried already, or ``MOST`` were."""
        if self._program() is None:
            return
        shapes = _shapes(sorted_feeds)
        with self._lock:
            if shapes in self._shapes or len(self._shapes) >= MOST:
                return
            if len(self._seen) > 64:  # a client of ever new shapes: counted afresh
                self._seen.clear()
            self._seen[shapes] = seen = self._seen.get(shapes, 0) + 1
            if seen < after:
                return
            self._shapes[shapes] = None
        PREPARE_POOL.submit(self._compile, shapes, list(sorted_feeds), list(expected))

    def _compile(self, shapes: tuple, sorted_feeds: list[np.ndarray], expected: list[np.ndarray]) -> None:
        why, seconds = "its session was given back", 0.0
        self._gate.enter()
        try:
            fn = self._program()
            if fn is not None:
                started = time.perf_counter()
                got = self._run(fn, sorted_feeds)
                seconds = time.perf_counter() - started
                for _ in range(WARM):
                    self._run(fn, sorted_feeds)
                why = disagreement(got, expected)
        except Exception as e:  # an op XLA cannot compile, most often
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        finally:
            self._gate.leave()
        self._shapes[shapes] = why is None
        shown = ", ".join(str(list(s)) for s in shapes)
        if why is None:
            log.info("client graph %s: XLA compiled its program for feed shapes %s in %.2f s", self._key, shown,
                     seconds)  # fmt: skip
        else:
            log.info("client graph %s: XLA does not serve feed shapes %s (%s); they run in TensorFlow's kernels",
                     self._key, shown, why)  # fmt: skip
            self._failed()


def _shapes(sorted_feeds: Sequence[np.ndarray]) -> tuple:
    return tuple(a.shape for a in sorted_feeds)
