"""How a client graph's runs that go alone (no other run of it going, nothing of it queued) run, learnt by trial.

Three modes:

- ``WORKER``: on its run worker, TensorFlow's ops one after another, each spread over the version's intra-op pool
  (every core servex may use);
- ``POOL``: handed to TensorFlow's inter-op pool (independent ops at once: a network's parallel branches);
- ``ONE_THREAD``: on its run worker, in the version's second session, whose intra-op pool has one thread
  (loader/one_thread.py). A model of many small ops loses more to spreading each op over the cores than it gains:
  on 2 cores in process, batch-1 ms on one thread against two, the encoder 8.6 against 10.2, MobileNetV2 13.6 against
  17.3, EfficientNetB0 20.8 against 25.3; ResNet-50 71.2 against 53.6, DenseNet-121 54.7 against 55.1 (its ops
  parallelize). A graph that takes this mode runs there under load too: two runs of one thread each on 2 cores served
  the five as much as or more than runs of two (batches of 16, 2 callers: 245 rows/s against 238, 144 against 136,
  104 against 100, 33 against 32, 35 against 34).

A small graph always runs on its worker (handing its ops over costs more than they take; the second session would cost
memory for nothing). A compute-bound one tries the modes it may take in turns (one thread only where its worker's lone
runs left the cores idle enough: ``ONE_THREAD_BUSY``; XLA's program, ``XLA_BUSY``; the pool, ``POOL_BUSY_SHARE`` of
the cores), until ``TRIALS`` runs of each at one
batch-size bucket were seen (after ``WARM``), then keeps the fastest, another than its worker only where it saves
``GAIN`` of the time (XLA's program: ``GAINS``). On 2 cores the worker and the pool came within 4% of each other on
every model measured (one process, both callables warm, run in turns, medians): DenseNet-121 51.6 ms an image on the
pool against 53.5 on its worker, ResNet-50 53.0 and 54.0, EfficientNetB0 24.5 and 25.0, MobileNetV2 16.7 and 16.6, the
encoder 10.8 and 10.4, a GRU 3.1 and 3.1; the pool is for graphs with independent branches on more cores than one op's
shards keep busy. Runs under load go on their worker (or in the one-thread session, or as XLA's programs, where chosen;
a graph that keeps the pool or XLA's programs, in the one-thread session where it beat the worker: client_graph.py): the
pool's parallel ops fill cores a run alone leaves idle, but under load other runs and the calls fill them (at 32 callers
on 2 cores the pool served a GRU 1,412-1,508 sequences/s against 1,425-1,717 on its worker).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np

from servex.executor.cost_model import COMPUTE_BOUND_SECONDS, bucket

log = logging.getLogger(__name__)

WORKER, POOL, ONE_THREAD, XLA = "worker", "pool", "one_thread", "xla"
# One thread is tried only where a lone run on its worker kept fewer cores than this busy (the process's CPU time
# over the run's wall time, the most of ``BUSY_RUNS`` runs: another process taking a core makes a run longer, not
# busier): one thread then takes about 0.55-0.8 of that CPU time. Measured on 2 cores, on two hosts (an Intel Xeon,
# an AMD EPYC): one thread was faster where the worker's runs kept few cores busy, the encoder (1.06-1.25 on the
# first: 8.6 ms against 10.2), MobileNetV2 (1.23-1.51: 13.6 against 17.3) and EfficientNetB0 (1.41-1.56: 19.1-20.8
# against 20.3-25.3); as fast or slower from about 1.55 up: MobileNetV2 on the second (1.50-1.66: 12.3 against 12.3,
# its worker's runs 12.5 ms in some processes and 18-20 in others), the encoder there (1.56-1.73: 11.0 against 8.8),
# DenseNet-121 (1.58-1.76: up to 64.7 against 45.9), ResNet-50 (1.79-1.90: 75-82 against 50-55).
ONE_THREAD_BUSY = 1.6
# The modes tried only there: XLA's gains too are a graph of ops too small to split. Its programs run on one thread
# (loader/xla.py), and its trial is the dearest (a third session, and a compile of 0.2-1.3 s of a core beside the
# requests: at 1 caller on 2 cores the encoder's mean latency over its first 5 s rose by 0.7-0.9 ms), so it is tried
# below a lower line: it gained where a lone run kept a core busy, or little more (a GRU, 1.00-1.04 in every run:
# 1.2-1.4 ms a row compiled against 2.8-3.5; the encoder on the first host, 1.06-1.25), and never above 1.5 (the
# encoder on the second, 1.54-1.73: 10.9-12.8 ms compiled against 8.5-8.8 on its worker). A graph that runs a loop
# tries it whatever its lone runs keep busy (xla_programs.py's LOOPS).
XLA_BUSY = 1.4
BUSY_LINE = {ONE_THREAD: ONE_THREAD_BUSY, XLA: XLA_BUSY}  # the modes tried only below a line, and their lines
# The inter-op pool runs independent ops at once on cores a lone run leaves idle: it is tried only where the worker's
# lone runs kept less than this share of the cores busy (TensorFlow's pools' threads). On 2 cores it never saved its
# 5% above one core busy (the GRU, 1.0: 2.4 ms a row against 3.1 in one process), and came within 4.4% of the worker
# from 1.54 up (MobileNetV2, EfficientNetB0, the encoder at 1.61-1.71, DenseNet-121 at 1.76, ResNet-50 at 1.80-1.90),
# while its trial, its callable made and first run beside the requests, raised ResNet-50's mean latency over the
# first seconds at 1 caller. Its callable is made after the graph's first lone run, where that run read under the
# line (client_graph.py): a first run reads fewer cores busy than the next (ResNet-50 1.59-1.66 against 1.82-1.90,
# MobileNetV2 1.28-1.38 against 1.41-1.56), and at 0.8 of 2 cores ResNet-50's first request made it half the time.
POOL_BUSY_SHARE = 0.75
BUSY_RUNS = 4
# A mode's trial ends where its first runs after its warm ones (how many: the first number) each took more than this
# many times its worker's typical run (the second): XLA's program at its first (MobileNetV2 ran 5x slower compiled),
# one thread at its second (a graph let in whose ops split over many cores would run several times slower there). Not
# closer: on a noisy host the first runs after the warm ones of a graph as fast on one thread read up to 1.37x. The
# worker's typical run is the median of its runs at that batch size (after its warm ones, once it has ``TYPICAL``),
# not its fastest: one lucky run (8.0 ms among runs of 14.0) dropped a mode whose runs took 15.0.
SLOWER = {XLA: (1, 1.5), ONE_THREAD: (2, 1.5)}
TYPICAL = 3
_WHERE = {
    WORKER: "its run worker",
    POOL: "TensorFlow's inter-op pool",
    ONE_THREAD: "one intra-op thread",
    XLA: "XLA's compiled program",
}


class ThreadModeChooser:
    """Which mode a client graph's lone runs take: tried in turns while serving, then kept."""

    # Trials happen while serving, so they are few: 18 runs of each in turns, the first 10 left out, chose the same
    # modes for the suite's models and a GRU, and raised ResNet-50's mean latency at 1 caller over the first seconds
    # from 52 ms to 60. Each mode's first ``WARM`` runs are left out: TensorFlow's executor learns over its first
    # runs which kernels to run inline, and a callable's first runs are slower by more than the modes differ.
    WARM = 5
    TRIALS = 5
    GAIN = 0.05
    # XLA's program is kept only where it saves far more: under load each batch size it meets is compiled for (0.2-5
    # s of a core beside the requests), and at a load's batch sizes it saves less than at one row (scripts/bench_xla.py,
    # two runs: a GRU 56-62% at 1 row, 19-40% at 8-32; the encoder -8% to 6% at 1, -17% to 13% at 8-32). The GRU's
    # lone runs saved 50-76% in every trial; the encoder's, chosen at 6% (inside the host's noise) and on an AMD EPYC
    # host at 27% (6.9 ms a row against 9.5 on its worker), then compiled 7 batch sizes at 32 callers (1.3-2.7 s of a
    # core each) while that level served 123 rows/s, against 286 in TensorFlow's kernels.
    GAINS = {XLA: 0.4}

    def __init__(
        self, name: str = "", modes: Sequence[str] = (WORKER, POOL), cores: int | None = None,
        ungated: Sequence[str] = (),
    ):  # fmt: skip
        self.name = name
        # The first run on its worker: a small graph is told at once, with nothing else made. One thread (and, where
        # the ``cores`` TensorFlow's pools may use are known, the inter-op pool) joins once the worker's runs showed
        # how busy they keep the cores; ``ungated`` modes are tried from the first runs, whatever they keep busy
        # (XLA's program for a loop: graph_executor.py).
        lines = {**BUSY_LINE, POOL: POOL_BUSY_SHARE * cores} if cores else dict(BUSY_LINE)
        self._lines = {m: line for m, line in lines.items() if m not in ungated}
        self.modes = [WORKER, *(m for m in modes if m != WORKER and m not in self._lines)]
        self._waiting = [m for m in self._lines if m in modes]  # tried once the worker's runs left cores idle enough
        self._gated = bool(self._waiting)
        self._busy: list[float] = []  # cores a lone run on its worker kept busy
        self.busy_cores: float | None = None  # the most of them, once measured
        self.mode: str | None = None  # None: not decided yet
        self.under_load = WORKER  # where runs under load go once ``mode`` is the pool or XLA (without a program)
        self._samples: dict[tuple[int, str], list[float]] = {}
        self._worker_runs: dict[int, list[float]] = {}  # per bucket, its worker's runs a row (warm runs too)
        self._warm = dict.fromkeys([WORKER, *modes], 0)  # runs of each mode so far, up to WARM
        if XLA in self._warm:
            self._warm[XLA] = self.WARM  # its program is run warm where it is compiled (client_graph.py)
        self._turn = -1
        self._lock = threading.Lock()

    @property
    def runs(self) -> int:
        """Runs alone before the choice, at most (of a graph whose runs are all of one bucket)."""
        return (len(self.modes) + len(self._waiting) * self._gated) * (self.WARM + self.TRIALS)

    @property
    def gated(self) -> bool:
        """Whether one thread waits for the worker's busy cores (``record``'s ``busy``)."""
        return self._gated

    def pick(self) -> str:
        """The mode of the next lone run."""
        if self.mode is not None:
            return self.mode
        self._turn = (self._turn + 1) % len(self.modes)
        return self.modes[self._turn]

    def may_try(self, mode: str, busy: float | None) -> bool:
        """Whether ``mode`` may still be tried, a lone run on its worker having kept ``busy`` cores busy (None: not
        measured): a mode that waits for the busy cores is not, where this run reached its line (the most of the
        first ``BUSY_RUNS`` runs decides)."""
        with self._lock:
            if self.mode is not None:
                return False
            if mode in self.modes:
                return True
            return mode in self._waiting and (busy is None or busy < self._lines[mode])

    def drop(self, mode: str) -> None:
        """``mode`` cannot be had (its callable or session could not be made): try the others."""
        with self._lock:
            if self.mode is not None or mode == WORKER:
                return
            if mode in self._waiting:
                self._waiting.remove(mode)
                self._gated = self._gated and bool(self._waiting)
                if not self._gated and self._busy:
                    self.busy_cores = max(self._busy)  # (what was measured, for the log)
            if mode in self.modes:
                self.modes.remove(mode)
            for b in {b for b, _ in self._samples}:
                if self._decide(b):
                    return
            if self.modes == [WORKER] and not self._gated:
                self.mode = WORKER

    def record(self, mode: str, rows: int, seconds: float, busy: float | None = None) -> None:
        """A lone run of ``rows`` rows took ``seconds`` in ``mode``; ``busy``: the cores it kept busy (a run on its
        worker, where nothing else of the process ran)."""
        if self.mode is not None:
            return
        rows = max(rows, 1)
        with self._lock:
            if self.mode is not None or mode not in self.modes:
                return
            if seconds < COMPUTE_BOUND_SECONDS and mode == WORKER:
                self.mode = WORKER  # a small graph: on its worker
                log.debug("client graph %s runs on its run worker: a lone run took %.2f ms", self.name, 1000 * seconds)
                return
            if busy is not None and mode == WORKER and self._gated:
                self._busy.append(busy)
                if len(self._busy) >= BUSY_RUNS:
                    self._gated = False
                    cores = self.busy_cores = max(self._busy)
                    tried = [m for m in self._waiting if cores < self._lines[m]]
                    self.modes.extend(tried)
                    log.debug("client graph %s: a lone run kept %.2f cores busy: %s tried", self.name, cores,
                              " and ".join(tried) or "nothing more")  # fmt: skip
            if mode == WORKER:
                self._worker_runs.setdefault(bucket(rows), []).append(seconds / rows)
            if self._warm[mode] < self.WARM:
                self._warm[mode] += 1
                return
            b = bucket(rows)
            self._samples.setdefault((b, mode), []).append(seconds / rows)
            self._drop_if_slower(mode, b)
            self._decide(b)

    def _drop_if_slower(self, mode: str, b: int) -> None:
        """Stop trying ``mode`` where its first runs at bucket ``b`` were all much slower than its worker's typical
        run (``SLOWER``; the lock is held)."""
        if mode not in SLOWER:
            return
        runs, factor = SLOWER[mode]
        samples = self._samples[b, mode]
        settled = self._samples.get((b, WORKER), [])  # its runs after its warm ones
        typical = settled if len(settled) >= TYPICAL else self._worker_runs.get(b)
        if len(samples) != runs or not typical:
            return
        worker = float(np.median(typical))
        if min(samples) <= factor * worker:
            return
        self.modes.remove(mode)
        log.info("client graph %s: %s is slower (%.1f ms a row against %.1f on its worker): not tried further",
                 self.name, _WHERE[mode], 1000 * min(samples), 1000 * worker)  # fmt: skip

    def _decide(self, b: int) -> bool:
        """Choose once every mode has ``TRIALS`` runs at bucket ``b`` (the lock is held)."""
        if self._gated:
            return False
        medians = {}
        for mode in self.modes:
            samples = self._samples.get((b, mode), [])
            if len(samples) < self.TRIALS:
                return False
            medians[mode] = float(np.median(samples))
        best = min(medians, key=lambda m: medians[m] / (1 - self.GAINS.get(m, self.GAIN)))
        if medians[best] >= medians[WORKER] * (1 - self.GAINS.get(best, self.GAIN)):
            best = WORKER  # a tie stays on the worker, which hands nothing over and holds no second session
        self.mode = best
        # Runs under load go in the one-thread session, several at once (lanes), where it beat the worker, whichever
        # mode the lone runs keep: XLA's (for runs whose shapes have no program yet: a batch's size, before it is
        # compiled for) or the pool's, which only fills cores a run alone leaves idle. Two one-thread runs at once
        # served the encoder more than two of two; on an AMD EPYC host MobileNetV2's trial read 17.2 ms a row on the
        # pool, 17.8 on one thread and 19.3 on its worker, and its batches under load on its worker served 60 images/s
        # at 32 callers, where lanes served 99-111.
        one = medians.get(ONE_THREAD)
        if best in (XLA, POOL) and one is not None and one < medians[WORKER] * (1 - self.GAIN):
            self.under_load = ONE_THREAD
        shown = [f"{1000 * medians[best]:.1f} ms a row there"]
        others = ", ".join(f"{1000 * s:.1f} ms on {_WHERE[m]}" for m, s in medians.items() if m != best)
        shown += [others or "no other mode tried"]
        if self.busy_cores is not None:
            shown.append(f"its lone runs on its worker kept {self.busy_cores:.2f} cores busy")
        log.info("client graph %s runs on %s (%s)", self.name, _WHERE[best], "; ".join(shown))
        return True
