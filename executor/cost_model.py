"""What the RunHandler learns of each client graph's runs while serving, and what it decides from it.

With automatic batching (the default), every run of a batchable client graph reports its rows and seconds here
(and the runs of it going at once, which share the cores: its time is divided by them). ``GraphCost`` keeps, per
batch-size bucket (1, 2-3, 4-7, 8-15, ...), the time per row of the last ``WINDOW`` runs, apart for runs that went
alone and runs that shared the cores with another run of it (two at once deliver more than one, so a shared run's
time divided by two is less than the same run's alone), and from their medians chooses:

- **the kind of graph** (from the fastest of the last one-row runs): *compute-bound* when one row's run takes at
  least ``COMPUTE_BOUND_SECONDS`` (the
  TensorFlow run is the cost: ResNet-50, an encoder), else *call-bound* (receiving, decoding and answering the call
  cost more than the run: a small MLP, an embedding lookup);
- **how many runs of it go at once**: for a compute-bound graph up to ``COMPUTE_BOUND_RUNS`` (two), each spread
  over every core by TensorFlow's intra-op pool: one run alone leaves the cores idle at each op's end (the pool
  waits for an op's last shard) and while the next batch's requests are received, and the second run's ops fill
  those gaps; but a graph of many tiny ops has no gaps to fill, and one run at a time serves it more: which of the
  two, a trial while it is busy tells (runs_at_once.py). As many as there are run workers for a call-bound graph,
  whose runs barely use a core each;
- **the largest batch**: the maximum for a call-bound graph; for a compute-bound one the knee of the measured
  curve, the smallest batch size whose time per row is within ``KNEE_TOLERANCE`` of the best size seen (its
  bucket's largest size; the maximum where that is within a quarter of it), on the curve of the kind of runs (alone
  or shared) that most of the last ``WINDOW`` were, from runs among the graph's last ``STALE_RUNS`` taken under
  about the load it has now (``LOAD_BAND``). Larger batches would hold more memory and make each caller wait longer
  for little more throughput, or less: past their knee, ResNet-50's and MobileNetV2's rows cost 10-35% more in
  batches of 16-32 on 2 cores. Where the curve was not seen ``KNEE_SPAN`` buckets beyond the knee (it may still
  fall beyond the largest batch seen), the limit grows to the bucket beyond the largest seen, at once, a bucket at
  a time: one-row runs seen, batches of up to 3 rows; then up to 7; and so on, each judged at its
  ``MIN_SAMPLES``-th run. While it grows into the graph's rows (queued, or in its other runs), no trial of runs at
  once begins. Once a knee is chosen,
  every ``EXPLORE_EVERY``-th batch may take the next bucket up (every other time the one beyond), so that a curve
  that changes (another input size, another load on the machine) is seen again. Another limit is taken once
  ``CONFIRMATIONS`` decisions in a row proposed it (growing beyond the largest batch seen, at once, and falling
  back from the bucket it grew into on that bucket's first measure); none during a trial of runs at once.

The first choice is made after ``MIN_SAMPLES`` runs, then every ``DECIDE_EVERY`` (and at the ``MIN_SAMPLES``-th run
of a bucket the limit grew into); a change is logged and shown in ``servex_scheduler_*`` gauges.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from servex.executor.runs_at_once import RunsAtOnce

log = logging.getLogger(__name__)

# A run of one row that takes at least this long is compute-bound: ten times what servex's event loop spends on
# a small call's receiving, decoding and answering on one core of this project's machines (about 0.2 ms).
COMPUTE_BOUND_SECONDS = 0.002
KNEE_TOLERANCE = 0.02  # a batch size is at the knee when its time per row is within 2% of the best size's
SHARED = 1.25  # a run that went with this many runs of its graph at once, on average, or more shared the cores
# A knee only where the curve was seen this many buckets beyond it (its rows times 4); else the limit grows a bucket.
# One bucket stopped at a dip: on an AMD EPYC host ResNet-50's rows cost as much in batches of 2 as of 1 (in
# process, 65.8 ms a row against 63.7) and 25% less from 16 up, and its limit stayed at 1-3 rows for seconds at 32
# callers. Looking two buckets beyond costs one bucket's first measure: a bucket the limit grew into is left at once
# where its rows were no cheaper (below). A knee taken at one load does not hold the limit at the next: runs of
# another load stop counting, and the curve there grows it again.
KNEE_SPAN = 2
KNEE_KEEP = 0.05  # a limit grows only once its bucket's time per row is 5% off the best (noise is not news)
CONFIRMATIONS = 3  # decisions in a row that must propose a new batch limit before it is taken
WINDOW = 16  # runs of each bucket whose median counts (a median: one run slowed by another thread is not news)
MIN_SAMPLES = 3  # runs a bucket needs before it counts
DECIDE_EVERY = 8  # runs between two decisions
EXPLORE_EVERY = 16  # with a knee below the maximum, every 16th batch may take the next bucket up (every other
# time two buckets up: the span beyond the knee stays seen)
# A bucket's runs count only while they are among the graph's last STALE_RUNS: runs measured under another load
# (fewer callers, fewer rows) are not compared with today's. MobileNetV2's 4-7-row runs from 8 callers came within
# 2% of its 16-31-row runs at 32, where the client takes more of the cores, and the limit fell to 7 rows.
STALE_RUNS = 8 * WINDOW
# And only runs taken under about the load the graph has now: a run's load is the graph's rows in the scheduler when
# its batch was taken (its own, those left queued, those in its other runs), the load now the median of the last
# WINDOW runs', and a run counts where its load is within LOAD_BAND times that, either way. MobileNetV2's one-row
# runs from one caller (12.9 ms a row alone) were still among its last 128 at 32 callers, within 2% of the 16-31-row
# runs there (12.7 ms), and the limit fell to 1 row: 0.67x in-process TensorFlow's best.
LOAD_BAND = 2.0
VERIFY_REQUESTS = 4  # requests of the first batch that are also run one by one to check batching's answers
# Runs of a compute-bound graph at once. Measured on 2 cores at 32 callers (batches up to 32, alternating servers):
# two runs at once served MobileNetV2 95-122 images/s against 83-100 for one, ResNet-50 22.4 against 19.4, the
# encoder 176 sequences/s against 153; one request alone still runs by itself on every core.
COMPUTE_BOUND_RUNS = 2


# Batched and one-by-one answers agree when each value is within this share of the output's largest magnitude (or
# a few of its dtype's steps, for low-precision floats): kernels sum in another order for another batch size, while
# a graph that mixes rows (a softmax over the batch, a batch's mean) answers differently by far more.
AGREE_TOLERANCE = 1e-3
_LOW_PRECISION_STEP = {"bfloat16": 2.0**-7, "float8_e4m3fn": 2.0**-3, "float8_e5m2": 2.0**-2}  # ml_dtypes' floats


def answers_agree(batched: Sequence[np.ndarray], alone: Sequence[np.ndarray]) -> bool:
    """Whether one request's rows cut from a batch's outputs (``batched``) are its answers run alone (``alone``)."""
    if len(batched) != len(alone):
        return False
    for a, b in zip(batched, alone, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        low = _LOW_PRECISION_STEP.get(a.dtype.name)
        if a.dtype.kind in "fc" or low is not None:
            step = low if low is not None else float(np.finfo(a.dtype).eps)
            wide = np.complex128 if a.dtype.kind == "c" else np.float64
            x, y = a.astype(wide), b.astype(wide)
            finite = np.isfinite(y)
            scale = float(np.max(np.abs(y[finite]))) if finite.any() else 0.0
            tolerance = max(AGREE_TOLERANCE, 8 * step)
            if not np.allclose(x, y, rtol=tolerance, atol=tolerance * scale, equal_nan=True):
                return False
        elif not np.array_equal(a, b):
            return False
    return True


def bucket(rows: int) -> int:
    """The bucket of a batch of ``rows`` rows: 0 for 1 row, 1 for 2-3, 2 for 4-7, ..."""
    return max(rows, 1).bit_length() - 1


@dataclass(frozen=True)
class Choice:
    """What the scheduler runs a client graph with."""

    compute_bound: bool
    concurrency: int  # runs of it at once
    batch_limit: int  # rows in one batch at most
    threads: int = 1  # TensorFlow's intra-op threads its runs use (its version's session's, or the one-thread one's)

    def describe(self) -> str:
        kind = "compute-bound" if self.compute_bound else "call-bound"
        runs = "1 run at a time" if self.concurrency == 1 else f"up to {self.concurrency} runs at once"
        threads = "1 intra-op thread" if self.threads == 1 else f"{self.threads} intra-op threads"
        return f"{kind}: batches of up to {self.batch_limit} rows, {runs}, {threads} per run"


class GraphCost:
    """The learned cost of one client graph's runs, and the scheduler's choice for it (thread-safe)."""

    def __init__(
        self,
        max_batch_size: int,
        workers: int,
        threads: int = 1,
        name: str = "",
        on_change: Callable[[Choice], None] | None = None,
        compute_runs: int = 1,
    ):
        self.max_batch_size = max_batch_size
        self.workers = workers  # runs at once of a call-bound graph
        self.threads = threads  # TensorFlow's intra-op threads of its version's session
        self.run_threads = threads  # those its runs use (1 in the version's one-thread session: most of the last)
        self._one_thread = deque(maxlen=WINDOW)  # whether each of the last runs went in the one-thread session
        self.name = name  # for the log line
        self.on_change = on_change
        self._lock = threading.Lock()
        # (shared, bucket) -> the last WINDOW runs' seconds per row, runs alone and runs that shared apart
        # (run's number, seconds a row, load: 0 where unknown)
        self._per_row: dict[tuple[bool, int], deque[tuple[int, float, int]]] = {}
        self._loads = deque(maxlen=WINDOW)  # the known loads of the last runs
        self._shared = deque(maxlen=WINDOW)  # whether each of the last runs shared the cores
        self._runs = 0
        self._batches = 0
        self._proposed, self._streak = 0, 0  # a new batch limit proposed, and how many decisions in a row did
        self._untried: int | None = None  # the bucket the limit last grew into before it was seen
        self._untried_runs = 0  # the runs of it since
        self._growing = False  # the last decision found the curve still falling at the largest batch seen
        self.running = 0  # runs of it going now (the RunHandler counts them under its lock)
        self.running_rows = 0  # the rows of those runs (the same)
        self.waiting = 0  # rows of it queued when its last batch was taken, that batch's included (the same)
        self.load = 0  # those and the rows of its other runs then (the same): the load its run is measured under
        # Batching's answers checked against runs one by one: None until a batch was checked.
        self.verified: bool | None = None
        self.choice = Choice(False, workers, max_batch_size, threads)
        self.runs = RunsAtOnce(compute_runs)  # a compute-bound graph's runs at once: 1, or compute_runs
        self.concurrency = workers  # runs of it that may go at once now (the choice's, or a trial's)
        self.compiled = False  # its last run's graph takes XLA's programs (client_graph.py)

    # -- what was seen -------------------------------------------------------------------------------------------

    def observe(
        self,
        rows: int,
        seconds: float,
        at_once: float = 1.0,
        waiting: int = 0,
        ended: float | None = None,
        one_thread: bool = False,
        compiled: bool = False,
        load: int = 0,
    ) -> Choice | None:
        """A run of ``rows`` rows took ``seconds`` while ``at_once`` runs of the graph went (this one included, on
        average over the run), ending at ``ended`` (by default now), its batch taken where ``waiting`` rows of the
        graph were queued (its own included); returns the new choice when this run changed it. Runs at once share
        the cores, so each takes longer for it: what counts is its time over ``at_once``, the time the cores gave
        its rows. Without it, one-row runs measured alone (one caller) looked twice as cheap per row as the batches
        two runs at once then ran (more callers), and the limit fell to 1 row for seconds at each rise of the load.
        A compute-bound graph's runs at once are learned by trial (runs_at_once.py). ``one_thread``: the run went
        in the version's one-thread session (thread_modes.py); ``compiled``: its graph's runs take XLA's programs
        (its batches are then padded to batching.py's ``program_rows``); ``load``: the graph's rows in the scheduler
        when its batch was taken (``waiting`` and the rows of its other runs; 0: unknown, it counts at any load)."""
        if rows < 1 or seconds < 0:
            return None
        self.compiled = compiled
        self._one_thread.append(one_thread)
        # A graph on XLA's programs runs in lanes whichever of its runs had a program yet: counted by its runs, it
        # flipped between lanes and one two-thread run at a time while its batch sizes compiled (the GRU at 32
        # callers: 14 times in 5 s), each flip halving the cores its compiled runs kept busy.
        self.run_threads = 1 if compiled or 2 * sum(self._one_thread) > len(self._one_thread) else self.threads
        ended = time.monotonic() if ended is None else ended
        with self._lock:
            shared = at_once >= SHARED
            if not (self.choice.compute_bound and self.runs.trying):  # a trial's runs say nothing of the kind
                self._shared.append(shared)
            key = (shared, bucket(rows))
            window = self._per_row.get(key)
            if window is None:
                window = self._per_row[key] = deque(maxlen=WINDOW)
            self._runs += 1
            window.append((self._runs, seconds / max(at_once, 1.0) / rows, load))
            if load > 0:
                self._loads.append(load)
            tried = None
            if self.choice.compute_bound:  # how many of its runs go at once: learned by trial (runs_at_once.py)
                # No trial begins while the limit still grows into the graph's rows (those queued, and those of its
                # other runs): its phases would run other batch sizes, and it held ResNet-50's limit at 3 rows for the
                # first 10 s at 32 callers. Not only the rows queued: of two runs at once at 32 callers, one takes the
                # limit's 15 rows and the other the 2 left, and the queued rows alone let a trial begin at that one.
                climbing = self._growing and max(waiting, load) > self.choice.batch_limit
                tried = self.runs.observe(rows, max(waiting, rows), ended - seconds, ended, self.running, climbing)
                self.concurrency = self._at_once(self.runs.now)
            # A bucket the limit grew into is judged at its first measure: its MIN_SAMPLES-th run, not the next
            # DECIDE_EVERY-th (ResNet-50's climb from 1 row to 32 at 32 callers took 17 s deciding every 8 runs).
            measured = False
            if key[1] == self._untried:
                self._untried_runs += 1
                measured = self._untried_runs == MIN_SAMPLES
            if tried is None and not measured and self._runs % DECIDE_EVERY and self._runs != MIN_SAMPLES:
                return None  # (a first choice soon)
            choice = self._decide()
            self.concurrency = self._at_once(self.runs.now) if choice.compute_bound else choice.concurrency
            if choice == self.choice:
                return None
            self.choice = choice
        if tried is not None:
            log.info("client graph %s: %s", self.name, ", ".join(
                f"{runs} at once served {rows_s:,.1f} rows/s" for runs, rows_s in sorted(self.runs.served.items())
            ))  # fmt: skip
        log.info("client graph %s: %s (%s)", self.name, choice.describe(), self._curve())
        if self.on_change is not None:
            self.on_change(choice)
        return choice

    def per_row_seconds(self, shared: bool | None = None) -> dict[int, float]:
        """The median time per row of the last runs alone (``shared`` False) or that shared the cores (True; None:
        the kind most of the last runs were), by bucket (of buckets seen at least ``MIN_SAMPLES`` times)."""
        with self._lock:
            return self._seen(self._sharing() if shared is None else shared)

    def _curve(self) -> str:
        """The curve the choice is made on, for the log line: a row's time by batch-size bucket."""
        with self._lock:
            shared = self._sharing()
            seen = self._seen(shared)
        sizes = {b: "1" if b == 0 else f"{1 << b}-{(2 << b) - 1}" for b in seen}
        shown = ", ".join(f"{sizes[b]} rows {seen[b] * 1000:.2f} ms" for b in sorted(seen)) or "none yet"
        return f"a row's time, runs {'shared' if shared else 'alone'}: {shown}"

    def _at_once(self, runs: int) -> int:
        """A compute-bound graph's runs at once: ``runs`` (its trial's), each over its version's intra-op pool; where
        its runs go in the one-thread session, as many as the pool has threads (the cores): 16 on 16 cores, not
        two one-thread runs."""
        return max(runs, self.threads) if self.run_threads == 1 < self.threads else runs

    def in_lanes(self) -> bool:
        """Whether the graph's runs go in the one-thread session, several at once (lanes): see lane_share."""
        return self.run_threads == 1 < self.threads and self.concurrency > 1

    def lane_share(self, queued: int) -> int:
        """For a graph in lanes, the most rows its next batch may take: its lane's share of the graph's rows,
        ``queued`` (the batch's own included) and those running in the other lanes. A row's time there barely falls
        with the batch, so a batch that takes every queued row only leaves the other lanes idle and its callers
        waiting for it: at 32 callers on two lanes, batches of 17-31 rows next to ones of 1-3, and p99 1.5-2.2 times
        p50 (MobileNetV2, the encoder, EfficientNetB0). A graph on its version's pool batches up to its knee."""
        return max(1, -(-(queued + self.running_rows) // self.concurrency))

    def _sharing(self) -> bool:
        return 2 * sum(self._shared) > len(self._shared)

    def _seen(self, shared: bool) -> dict[int, float]:
        seen = {}
        now = statistics.median(self._loads) if self._loads else 0
        low, high = now / LOAD_BAND, now * LOAD_BAND
        for (kind, b), window in self._per_row.items():
            fresh = [t for n, t, load in window if n > self._runs - STALE_RUNS and (not load or low <= load <= high)]
            if kind == shared and len(fresh) >= MIN_SAMPLES:
                seen[b] = statistics.median(fresh)
        return seen

    # -- what is chosen ------------------------------------------------------------------------------------------

    def _decide(self) -> Choice:
        seen = self._seen(self._sharing())  # the curve of the kind of runs the graph runs now
        one_rows = [t for (_, b), w in self._per_row.items() if b == 0 and len(w) >= MIN_SAMPLES for _, t, _ in w]
        if not seen and not one_rows:
            return self.choice
        # From one-row runs only (a larger batch's time says little of one row's where the call is the cost), and
        # from the fastest of the last ones: under load a run's wall time grows while the event loop or another run
        # takes the core, and contention only ever adds time, so the fastest run is the graph's own cost (a median
        # of a call-bound graph's one-row runs under 32 callers crossed the threshold now and then and flipped the
        # choice). A band between the two thresholds keeps a graph near them from flipping back and forth.
        one_row = min(one_rows) if one_rows else None
        if one_row is None:
            compute_bound = self.choice.compute_bound
        elif self.choice.compute_bound:
            compute_bound = one_row >= COMPUTE_BOUND_SECONDS / 2
        else:
            compute_bound = one_row >= COMPUTE_BOUND_SECONDS
        # Runs on one thread (a graph found faster there, or on XLA's programs) keep one core each: however fast
        # its one-row runs, it runs in lanes, one per core (the GRU's lone runs took 1.1 ms on XLA's program, and
        # one batch at a time left the second core to the event loop's 0.4 of it: 1,500 sequences/s at 32
        # callers against 1,700-1,750 in two lanes).
        compute_bound = compute_bound or self.run_threads == 1 < self.threads
        concurrency = self._at_once(self.runs.chosen) if compute_bound else self.workers
        if not compute_bound:  # the call is the cost: a larger batch only saves hand-offs
            self._growing = False
            return Choice(False, concurrency, self.max_batch_size, self.run_threads)
        if not seen or self.runs.trying:  # during a trial of runs at once, its runs are of either kind
            return Choice(True, concurrency, self.choice.batch_limit, self.run_threads)
        if self.run_threads == 1 < self.threads:
            # Runs on one thread: a row's time barely falls with the batch (MobileNetV2's 1, 2-3 and 4-7-row runs
            # within 7% of each other, in either order), so a knee is noise, and a limit that fell to 1 row and rose
            # again made p99 three times p50 at 32 callers. Larger batches save a hand-off per row: the maximum.
            self._growing = False
            return Choice(True, concurrency, self.max_batch_size, self.run_threads)
        best = min(seen.values())
        knee = min(b for b, s in seen.items() if s <= best * (1 + KNEE_TOLERANCE))
        top = max(seen)
        growing = self._growing = top < knee + KNEE_SPAN and not self._covers_max(seen)
        if growing:  # the curve was not seen flat beyond the knee: larger may be better still, one bucket beyond
            limit = self._up_to(top + 1)  # the largest seen (not the maximum: ResNet-50's 16-31-row batches
        else:  # served 10 images/s at 32 callers, its 4-7-row ones 12)
            limit = self._up_to(knee)
        current = bucket(self.choice.batch_limit)
        keep = current in seen and seen[current] <= best * (1 + KNEE_KEEP) and not (growing and current >= top)
        if limit > self.choice.batch_limit and keep:
            limit = self.choice.batch_limit  # larger only where the current limit is clearly worse: not for noise
        if growing:
            if self._untried != top + 1:
                self._untried, self._untried_runs = top + 1, 0
            if limit > self.choice.batch_limit:
                self._streak = 0  # a bucket not seen yet is tried at once: nothing is known of it to confirm
                return Choice(compute_bound, concurrency, limit, self.run_threads)
        # A bucket grown into unseen is judged on its first measure, unconfirmed too: left at once where its rows
        # were no cheaper than the knee's. Confirmed, ResNet-50's limit of 32, grown into at 32 callers, stood 30 s
        # (24 runs of ~16 rows) before it fell back.
        if self._untried in seen:
            self._untried = None
            if limit < self.choice.batch_limit:
                self._streak = 0
                return Choice(compute_bound, concurrency, limit, self.run_threads)
        # A new limit only once three decisions in a row proposed it: a bucket's median moved by noise is not news.
        if limit != self.choice.batch_limit and self.choice.compute_bound:
            self._streak = self._streak + 1 if limit == self._proposed else 1
            self._proposed = limit
            if self._streak < CONFIRMATIONS:
                limit = self.choice.batch_limit
        else:
            self._streak = 0
        return Choice(compute_bound, concurrency, limit, self.run_threads)

    def _up_to(self, b: int) -> int:
        """The limit of a batch up to bucket ``b``: its largest size; the maximum where that is within a quarter of
        it (31 of 32 saves nothing: only log lines)."""
        limit = max(1, (2 << b) - 1)
        return self.max_batch_size if 4 * limit >= 3 * self.max_batch_size else limit

    def _covers_max(self, seen: dict[int, float]) -> bool:
        """Whether the largest bucket seen already allows the maximum batch (nothing beyond it to grow into)."""
        return self._up_to(max(seen)) >= self.max_batch_size

    def batch_limit(self) -> int:
        """The rows the next batch may take: the choice's limit, the next bucket's on every ``EXPLORE_EVERY``-th."""
        limit = self.choice.batch_limit
        if limit >= self.max_batch_size:
            return limit
        self._batches += 1
        if self._batches % EXPLORE_EVERY == 0:  # the next bucket up, whole; every other time the one beyond
            up = 2 if self._batches % (2 * EXPLORE_EVERY) == 0 else 1
            return min(self.max_batch_size, (2 << (bucket(limit) + up)) - 1)
        return limit
