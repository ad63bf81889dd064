"""The runs at once of a compute-bound graph, learned by trial (executor/runs_at_once.py), on synthetic loads: a
fake clock, and runs whose pace gives each count of runs at once its rows a second. No timing is measured."""

from __future__ import annotations

import pytest

from servex.executor.cost_model import Choice, GraphCost
from servex.executor.runs_at_once import AGAIN, RECENT, RunsAtOnce


def serve(counter, rate: dict[int, float], seconds: float, t: float = 0.0, rows: int = 8, waiting: int = 32):
    """Feed ``counter`` (a RunsAtOnce, or a GraphCost's) runs of ``rows`` rows for ``seconds`` of fake time from
    ``t``: with c runs at once, c runs overlap and together deliver ``rate[c]`` rows a second. Returns the time at
    the end and the choices it returned, with their times."""
    changes, end = [], t + seconds
    while t < end:
        c = counter.now
        run = rows * c / rate[c]  # each run's time; one of the c going ends every run / c
        t += run / c
        change = counter.observe(rows, waiting, t - run, t, c)
        if change is not None:
            changes.append((round(t, 2), change))
    return t, changes


def test_a_graph_that_one_run_at_a_time_serves_better_runs_one_at_a_time():
    # A GRU-like graph: one run at a time (twice the rows a batch) serves 1,200 rows a second, two at once 1,000.
    counter = RunsAtOnce(2)
    _, changes = serve(counter, {1: 1200.0, 2: 1000.0}, 10)
    assert [c for _, c in changes] == [1]
    assert counter.chosen == counter.now == 1
    assert counter.served == {1: pytest.approx(1200, rel=0.05), 2: pytest.approx(1000, rel=0.05)}


def test_a_graph_that_two_runs_at_once_serve_better_keeps_two():
    # A convolution network: two at once fill each other's idle gaps (100 images a second against 80).
    counter = RunsAtOnce(2)
    _, changes = serve(counter, {1: 80.0, 2: 100.0}, 30)
    assert changes == [] and counter.chosen == counter.now == 2
    assert counter.served == {1: pytest.approx(80, rel=0.05), 2: pytest.approx(100, rel=0.05)}  # it was tried


def test_a_difference_within_the_gain_keeps_the_current_count():
    counter = RunsAtOnce(2)
    serve(counter, {1: 1030.0, 2: 1000.0}, 10)
    assert counter.served and counter.chosen == 2


class Drifting:
    """Rows a second for ``serve`` that drift between the phases of a count: ``rates[i]`` in the i-th stretch of
    runs at one count (a stretch ends where the count changes), the last one after."""

    def __init__(self, rates: list[float]):
        self.rates, self.stretch, self.last = rates, 0, None

    def __getitem__(self, count: int) -> float:
        if self.last is not None and count != self.last:
            self.stretch += 1
        self.last = count
        return self.rates[min(self.stretch, len(self.rates) - 1)]


def test_a_trial_judges_the_other_count_against_the_current_counts_mean_not_its_best_phase():
    # Two at once read 1,175 then 1,300 rows a second (a noisy host); one at a time 1,340 both times: 8% over their
    # mean, 3% over the better phase. The mean is what the current count serves.
    counter = RunsAtOnce(2)
    _, changes = serve(counter, Drifting([1175.0, 1340.0, 1300.0, 1340.0]), 10)
    assert [c for _, c in changes] == [1]
    assert counter.served[1] > 1.05 * counter.served[2]
    # The same spread with the other count no better than their mean keeps the current one.
    counter = RunsAtOnce(2)
    _, changes = serve(counter, Drifting([1175.0, 1260.0, 1300.0, 1260.0]), 10)
    assert changes == [] and counter.chosen == 2


def test_no_trial_while_requests_come_one_at_a_time():
    counter = RunsAtOnce(2)
    seen = set()
    t = 0.0
    for _ in range(10):
        t, changes = serve(counter, {1: 1200.0, 2: 1000.0}, 1, t, rows=1, waiting=1)
        seen.add(counter.now)
    assert seen == {2} and counter.served == {} and counter.chosen == 2


def test_no_trial_for_runs_so_long_that_it_would_take_most_of_a_load():
    # ResNet-like: a run of 8 images takes 0.8 s two at once; a trial would take 19 s.
    counter = RunsAtOnce(2)
    serve(counter, {1: 25.0, 2: 20.0}, 120)
    assert counter.served == {} and counter.chosen == 2


def test_one_count_only_is_never_tried():
    counter = RunsAtOnce(1)
    serve(counter, {1: 1000.0}, 5)
    assert counter.served == {} and counter.now == 1


def test_a_trial_is_made_again_when_the_load_rises_and_after_a_while():
    counter = RunsAtOnce(2)
    t, changes = serve(counter, {1: 400.0, 2: 500.0}, 10)  # 8 callers: two at once serve more
    assert changes == [] and counter.chosen == 2 and counter.trials == 1
    # 32 callers: it delivers twice the rows, and one run at a time (twice the batch) now serves more.
    t, changes = serve(counter, {1: 1200.0, 2: 1000.0}, 10, t)
    assert [c for _, c in changes] == [1] and counter.trials == 2
    # Less load is no reason for a trial: the next comes after AGAIN trials' lengths.
    t, changes = serve(counter, {1: 400.0, 2: 500.0}, 5, t)
    assert changes == [] and counter.trials == 2
    # A steady load: tried again after AGAIN times a trial's length, with the same outcome.
    steady = RunsAtOnce(2)
    serve(steady, {1: 800.0, 2: 1000.0}, 120)
    assert steady.chosen == 2 and 2 <= steady.trials <= 120 / (AGAIN * 2) + 1


def test_the_trial_drives_the_graph_cost_its_concurrency_and_its_choice():
    changes = []
    cost = GraphCost(max_batch_size=32, workers=1, compute_runs=2, on_change=changes.append)
    for _ in range(RECENT):
        cost.observe(1, 0.010)  # compute-bound, one row at a time: batches up to 2-3 rows first
    assert cost.choice == Choice(True, 2, 3) and cost.concurrency == 2
    seen = set()

    class Feed:  # serve() through the GraphCost: observe(rows, waiting, started, ended, running)
        @property
        def now(self):
            seen.add(cost.concurrency)
            return cost.concurrency

        def observe(self, rows, waiting, started, ended, running):
            cost.running = running
            choice = cost.observe(rows, ended - started, running, waiting, ended=ended)
            return None if choice is None else choice.concurrency

    serve(Feed(), {1: 1200.0, 2: 1000.0}, 10)
    assert seen == {1, 2}
    assert cost.choice.concurrency == cost.concurrency == 1
    assert changes[-1].concurrency == 1
