"""How many runs of a compute-bound client graph go at once: one, or ``most`` (``--auto_compute_bound_runs``, by
default cost_model.py's ``COMPUTE_BOUND_RUNS``), learned by trying both while the graph is busy. ``GraphCost``
feeds it every run of the graph, under its lock.

Two runs at once fill each other's idle gaps (each op's last shard, the hand-over to the next batch): on 2 cores
they served MobileNetV2, ResNet-50 and an encoder 10-20% more than one at a time. A GRU's runs are 64 steps of
tiny ops that leave no gaps to fill: two at once contend for the intra-op pool, and one at a time, with twice the
rows in each batch, served it 1.3x more at 32 callers. A run's own time cannot tell the two apart (what matters is
the rows the cores deliver under the whole load), so a trial measures that. While batches form, it serves phases
in turns: B0 (the current count), A1 (the other), B1, and only where A1 served ``GAIN`` more than the B phases
around it did on average, A2; the other count is taken where A2 too served ``GAIN`` more than that (one phase's
noise is not news). Against their mean, not the better B phase: a phase's rate is noisy (a 1-s phase on a 2-core VM
read 1,175-1,436 rows/s for a GRU's two at once), and the better of two noisy phases is biased up. A GRU that one at
a time served 1,550-1,750 rows/s at 32 callers and two at once 1,200-1,450 kept two in 2 of 5 trials judged against
the better B phase (its A1 3.2% and 4.5% over it); against the mean all five A1 phases passed (5.3-13.9%).
A graph that the other count serves worse spends one phase in it. A phase counts the rows delivered per second
(a run that spans two phases counted in each for its share of its time there), after its first ``SETTLE`` runs
(the other count's runs still end, the queue and the batches adapt).

A trial is made once the graph is busy (the median load of its last runs, a run's rows and the rows left queued when it
took them, is 2 or more rows) and its batch limit no longer grows into its rows, queued or in its other runs
(cost_model.py: the trial's phases would run batches of other sizes), again when the rows it delivers a second rose by
``MOVE`` since the last trial (more callers: larger batches, which may change the best count), and in any case after
``AGAIN`` times the last trial's length. No trial where it would last over ``TRIAL_MOST_SECONDS`` (long runs, whose
large ops are those that two runs at once serve best, and where a trial would span most of a load's change): they keep
``most``.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

SETTLE = 4  # a phase's first runs, left out of its count
PHASE_RUNS = 8  # runs a phase counts, at least
PHASE_SECONDS = 1.0  # and seconds, at least (on a 2-core VM, rows a second varied 15% over half a second)
GAIN = 0.05  # the other count is taken where both of its phases served 5% more than the phases beside them
RECENT = 16  # runs whose median load tells whether the graph is busy, and whose median time a trial's length
MOVE = 1.5  # rows a second grew by this factor since the last trial: the load rose, a trial is made again
AGAIN = 10  # a trial is made again after ten times the last one's length (at most a tenth of the time in trials)
TRIAL_MOST_SECONDS = 8.0  # no trial that would take longer (4 phases of SETTLE + PHASE_RUNS runs)


@dataclass
class _Phase:
    runs: int  # runs at once in it
    switched: float  # when it began
    start: float | None = None  # when its count began: once SETTLE of its runs ended
    settled: int = 0
    end: float | None = None
    rows: float = 0.0  # rows delivered in it (a run's rows times its share of time in it)
    ran: int = 0  # runs that started and ended in it, once counting

    def rate(self) -> float:
        return self.rows / max(self.end - self.start, 1e-9)


class RunsAtOnce:
    """The runs at once of one compute-bound client graph: ``now`` (during a trial, its phase's), and ``chosen``.
    Not thread-safe: GraphCost calls it under its lock."""

    def __init__(self, most: int):
        self.most = most
        self.chosen = most
        self.now = most
        self.served: dict[int, float] = {}  # rows a second at each count, as the last trial measured
        self._loads: deque[int] = deque(maxlen=RECENT)
        self._runs: deque[tuple[float, float, int]] = deque(maxlen=RECENT)  # started, ended, rows
        self._phases: list[_Phase] = []  # the trial's, while one goes
        self._pending = 0  # runs going when a phase to judge ended, not ended yet
        self._again = 0.0  # when a trial is made again in any case
        self._rate = 0.0  # rows a second that the chosen count served at the last trial
        self.trials = 0  # trials made

    @property
    def trying(self) -> bool:
        """Whether a trial goes (its phases set ``now``, not ``chosen``)."""
        return bool(self._phases)

    def observe(
        self, rows: int, waiting: int, started: float, ended: float, running: int, hold: bool = False
    ) -> int | None:
        """A run of ``rows`` rows went from ``started`` to ``ended`` (``waiting``: its rows and the rows of the graph
        left queued when it took them), while ``running`` runs of the graph went (this one included); returns the
        new choice when a trial ended with another one. ``hold``: no trial begins now (the batch limit still grows:
        the trial's phases would run batches of other sizes)."""
        self._loads.append(waiting)
        self._runs.append((started, ended, rows))
        if self.most <= 1 or len(self._loads) < RECENT:
            return None
        busy = statistics.median(self._loads) >= 2  # else one request at a time: nothing queues, no count matters
        if self._phases:
            return self._count(rows, started, ended, running, busy)
        if not busy or hold or self._trial_seconds() > TRIAL_MOST_SECONDS:
            return None
        rate = self._recent_rate()
        moved = self._rate > 0 and rate > self._rate * MOVE  # more load: batches grow, the best count may change
        if self._rate and not moved and ended < self._again:
            return None
        self._start(ended)
        return None

    def _trial_seconds(self) -> float:
        """How long a trial would take at the last runs' pace: runs of a trial over the runs that go at once."""
        run = statistics.median(ended - started for started, ended, _ in self._runs)
        return run * 4 * (SETTLE + PHASE_RUNS) / self.now

    def _recent_rate(self) -> float:
        """Rows a second the last runs delivered."""
        first = min(started for started, _, _ in self._runs)
        last = max(ended for _, ended, _ in self._runs)
        return sum(rows for _, _, rows in self._runs) / max(last - first, 1e-9)

    def _start(self, at: float) -> None:
        other = 1 if self.chosen == self.most else self.most
        self.now = other if len(self._phases) % 2 else self.chosen  # B0, A1, B1, A2
        self._phases.append(_Phase(self.now, at))

    def _count(self, rows: int, started: float, ended: float, running: int, busy: bool) -> int | None:
        for phase in self._phases:
            if phase.start is None:  # settling
                phase.settled += started >= phase.switched
                if phase.settled >= SETTLE:
                    phase.start = ended
                continue
            end = ended if phase.end is None else phase.end
            share = min(ended, end) - max(started, phase.start)
            if share > 0:
                phase.rows += rows * share / max(ended - started, 1e-9)
                phase.ran += started >= phase.start and phase.end is None
        last = self._phases[-1]
        if last.end is not None:  # a phase to judge is over: its count waits for the runs going at its end (for a
            if started < last.end:  # phase's length at most: a run that failed reports nothing)
                self._pending -= 1
            if self._pending <= 0 or ended - last.end > last.end - last.start:
                return self._judge(ended)
            return None
        if not busy:  # the load went: nothing to compare
            self._phases, self.now = [], self.chosen
            return None
        if last.start is None or ended - last.start < PHASE_SECONDS or last.ran < PHASE_RUNS:
            return None
        last.end = ended
        if len(self._phases) < 3:
            self._start(ended)
            return None
        self.now = self.chosen  # (the next phase, if any, once judged)
        self._pending = running - 1  # the others going now started before the phase ended
        return self._judge(ended) if self._pending <= 0 else None

    def _judge(self, now: float) -> int | None:
        """After B1: the other count goes on to A2 only where A1 served GAIN more than the B phases around it did on
        average; after A2: it is taken only where A2 did so too."""
        rates = [phase.rate() for phase in self._phases]
        current = (rates[0] + rates[2]) / 2
        better = all(rate > current * (1 + GAIN) for rate in rates[1::2])
        if len(self._phases) == 3:
            if better:
                self._start(now)
                return None
            return self._finish(False)
        return self._finish(better)

    def _finish(self, switch: bool) -> int | None:
        served: dict[int, list[float]] = {}
        for phase in self._phases:
            total = served.setdefault(phase.runs, [0.0, 0.0])
            total[0] += phase.rows
            total[1] += phase.end - phase.start
        self.served = {runs: rows / seconds for runs, (rows, seconds) in served.items()}
        first, last = self._phases[0], self._phases[-1]
        self._again = last.end + AGAIN * (last.end - first.switched)
        self._phases = []
        self.trials += 1
        before = self.chosen
        if switch:
            self.chosen = 1 if before == self.most else self.most
        self.now = self.chosen
        self._rate = self.served[self.chosen]
        return self.chosen if self.chosen != before else None
