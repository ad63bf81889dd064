"""The automatic batching's cost model on synthetic cost curves: what it chooses for compute-bound, call-bound and
mixed graphs, and how it follows a curve that changes over time. No timing: the run times are given."""

from __future__ import annotations

import numpy as np
import pytest

from servex.executor.cost_model import (
    COMPUTE_BOUND_SECONDS,
    DECIDE_EVERY,
    EXPLORE_EVERY,
    STALE_RUNS,
    Choice,
    GraphCost,
    answers_agree,
    bucket,
)


def feed(cost: GraphCost, curve, sizes, rounds: int = 10) -> None:
    """Report ``rounds`` runs at each of ``sizes`` rows, each taking ``curve(rows)`` seconds."""
    for _ in range(rounds):
        for rows in sizes:
            cost.observe(rows, curve(rows))


SIZES = (1, 2, 4, 8, 16, 32)


def test_buckets_are_powers_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 7, 8, 31, 32, 33)] == [0, 1, 1, 2, 2, 3, 4, 5, 5]


def test_a_compute_bound_graph_runs_one_at_a_time_in_batches_up_to_the_knee():
    # On 2 cores: 4 ms fixed + 47 ms per image: per image 51, 49, 48, 47.5, 47.25, 47.1 ms.
    cost = GraphCost(max_batch_size=32, workers=4, threads=2)
    feed(cost, lambda rows: 0.004 + 0.047 * rows, SIZES)
    choice = cost.choice
    assert choice.compute_bound and choice.concurrency == 1
    per_row = cost.per_row_seconds()
    best = min(per_row.values())
    # The knee: the smallest bucket within 2% of the best; the limit is that bucket's largest size.
    knee = min(b for b, s in per_row.items() if s <= best * 1.02)
    assert choice.batch_limit == (2 << knee) - 1
    assert 1 < choice.batch_limit < 32


def test_a_knee_within_a_quarter_of_the_maximum_is_the_maximum():
    # Per row falling until 16 rows, flat beyond: the knee bucket is 16-31; its largest size, 31, would save nothing
    # against the maximum of 32, and noise would swap the two back and forth.
    changes = []
    cost = GraphCost(max_batch_size=32, workers=1, on_change=changes.append)
    feed(cost, lambda rows: 0.010 * max(rows, 16), SIZES)
    assert cost.per_row_seconds()[4] <= min(cost.per_row_seconds().values()) * 1.02
    assert cost.choice.compute_bound and cost.choice.batch_limit == 32
    assert all(choice.batch_limit == 32 for choice in changes)


def test_a_call_bound_graph_runs_on_every_worker_and_batches_to_the_maximum():
    # A small MLP: 0.1 ms a run whatever its size up to 32 rows (the per-row cost keeps falling).
    cost = GraphCost(max_batch_size=32, workers=4, threads=2)
    feed(cost, lambda rows: 0.0001 + 0.000002 * rows, SIZES)
    assert cost.choice == Choice(compute_bound=False, concurrency=4, batch_limit=32, threads=2)


def test_the_choice_says_the_threads_its_runs_use():
    # Its version's session's threads, until most of its runs go in the version's one-thread session
    # (thread_modes.py): then as many runs at once as that session's pool would have had threads, and batches to
    # the maximum (a one-thread run's time per row barely falls with the batch: a knee would be noise).
    changes = []
    cost = GraphCost(max_batch_size=32, workers=1, threads=4, on_change=changes.append)
    feed(cost, lambda rows: 0.010 * rows, (1,), rounds=DECIDE_EVERY)
    assert cost.choice.threads == 4 and "4 intra-op threads per run" in cost.choice.describe()
    assert cost.choice.compute_bound and cost.choice.concurrency == 1
    for i in range(2 * DECIDE_EVERY):
        rows = 1 << (i % 4)
        cost.observe(rows, 0.008 * rows * (1 + 0.01 * (i % 3)), one_thread=True)  # flat, with noise
    assert cost.choice == Choice(True, 4, 32, 1) and changes[-1].threads == 1
    assert "1 intra-op thread per run" in cost.choice.describe()
    cost.observe(1, 0.008)  # one stray run on the version's session (a trial's): the choice stands
    for _ in range(DECIDE_EVERY - 1):
        cost.observe(1, 0.008, one_thread=True)
    assert cost.choice.threads == 1


def test_a_graph_in_one_thread_lanes_takes_its_lanes_share_of_its_rows():
    # Runs in the one-thread session, four at once (4 threads): a batch takes its share of the queued rows and those
    # running in the other lanes, so that no lane takes every row while the others idle.
    cost = GraphCost(max_batch_size=32, workers=1, threads=4)
    assert not cost.in_lanes()  # its version's session: batches up to its knee, no share
    for i in range(2 * DECIDE_EVERY):
        cost.observe(1 << (i % 4), 0.008 * (1 << (i % 4)), one_thread=True)
    assert cost.in_lanes() and cost.concurrency == 4
    assert cost.lane_share(32) == 8
    assert cost.lane_share(1) == 1  # a lone request runs at once
    cost.running_rows = 24  # three lanes running 8 rows each
    assert cost.lane_share(1) == 7 and cost.lane_share(8) == 8
    for _ in range(DECIDE_EVERY):
        cost.observe(8, 0.064)  # its runs went back to the version's session
    assert not cost.in_lanes()


def test_a_mixed_graph_is_compute_bound_when_one_row_costs_more_than_the_call():
    # 3 ms per run, flat in rows until 8, then linear: the knee sits at 8.
    cost = GraphCost(max_batch_size=64, workers=3)
    feed(cost, lambda rows: 0.003 * max(1, rows / 8), (1, 2, 4, 8, 16, 32, 64))
    assert cost.choice.compute_bound and cost.choice.concurrency == 1
    assert cost.choice.batch_limit == 15  # bucket 8-15: per row 0.375 ms, as at 16 and beyond


def test_the_first_runs_classify_the_graph():
    cost = GraphCost(max_batch_size=32, workers=5)
    for seconds in (COMPUTE_BOUND_SECONDS * 10, COMPUTE_BOUND_SECONDS * 3, COMPUTE_BOUND_SECONDS * 3):
        cost.observe(1, seconds)  # the first run is slow (TensorFlow's first run of a callable), the next too
    assert cost.choice.compute_bound and cost.choice.concurrency == 1
    cost = GraphCost(max_batch_size=32, workers=5)
    for seconds in (COMPUTE_BOUND_SECONDS * 10, COMPUTE_BOUND_SECONDS / 10, COMPUTE_BOUND_SECONDS / 10):
        cost.observe(1, seconds)  # a slow first run alone says nothing
    assert not cost.choice.compute_bound and cost.choice.concurrency == 5


def test_while_the_curve_falls_the_limit_grows_one_bucket_beyond_the_largest_batch_seen():
    # Not to the maximum at once: ResNet-50's batches of 16-31 rows served 10 images/s at 32 callers on 2 cores,
    # its 4-7-row ones 12.
    changes = []
    cost = GraphCost(max_batch_size=32, workers=1, on_change=changes.append)
    falling = lambda rows: 0.05 * rows**0.5  # noqa: E731  still falling per row at the largest size seen
    feed(cost, falling, (1,), rounds=3)
    assert cost.choice == Choice(True, 1, 3)  # one-row runs seen: up to 2-3 rows
    feed(cost, falling, (1, 2), rounds=DECIDE_EVERY)
    assert cost.choice.batch_limit == 7  # unconfirmed: nothing is known of 4-7 rows to confirm
    feed(cost, falling, (1, 2, 4), rounds=DECIDE_EVERY)
    assert cost.choice.batch_limit == 15
    feed(cost, falling, (1, 2, 4, 8), rounds=DECIDE_EVERY)
    assert cost.choice.batch_limit == 32  # 31 would save nothing against the maximum
    assert [c.batch_limit for c in changes] == [3, 7, 15, 32]
    # Where the curve turned up beyond the knee, the limit falls back to the knee's bucket (once confirmed).
    turned = lambda rows: rows * (0.030 if rows < 4 else 0.020 if rows < 8 else 0.023)  # noqa: E731
    feed(cost, turned, (1, 2, 4, 8, 16), rounds=16)
    assert cost.choice.batch_limit == 7


def test_the_choice_follows_a_curve_that_changes_over_time():
    cost = GraphCost(max_batch_size=32, workers=2)
    flat = lambda rows: 0.010 * rows  # noqa: E731  each row costs the same: no size is better than one
    feed(cost, flat, SIZES, rounds=6)
    assert cost.choice.batch_limit == 1 and cost.choice.compute_bound
    # Then the machine frees up / inputs change: large batches become far cheaper per row.
    cheaper = lambda rows: 0.004 + 0.0001 * rows  # noqa: E731
    feed(cost, cheaper, SIZES, rounds=12)
    assert cost.choice.batch_limit == 32
    assert cost.choice.compute_bound  # a row alone still takes 4.1 ms
    # And back to a call-bound cost.
    feed(cost, lambda rows: 0.0002, SIZES, rounds=20)
    assert not cost.choice.compute_bound and cost.choice.concurrency == 2


def test_with_a_knee_below_the_maximum_every_sixteenth_batch_explores_one_or_two_buckets_up():
    cost = GraphCost(max_batch_size=32, workers=1)
    feed(cost, lambda rows: 0.010 * rows, SIZES, rounds=6)
    assert cost.choice.batch_limit == 1
    limits = [cost.batch_limit() for _ in range(4 * EXPLORE_EVERY)]
    assert limits.count(3) == 2 and limits.count(7) == 2 and set(limits) == {1, 3, 7}
    assert limits[EXPLORE_EVERY - 1] == 3 and limits[2 * EXPLORE_EVERY - 1] == 7


def test_runs_of_another_load_stop_counting():
    # MobileNetV2, two runs at once: at 8 callers batches of 4-7 rows, 8.2 ms a row; then at 32 callers batches of 8
    # and 16 rows, 9.5 and 8.6 ms a row, the client taking more of the cores. Compared with 8 callers' runs, 4-7
    # rows look best, and the limit falls to 7 rows.
    cost = GraphCost(max_batch_size=32, workers=1)
    for _ in range(4):
        cost.observe(1, 0.012)  # one caller
    for _ in range(16):
        cost.observe(4, 2 * 4 * 0.0082, at_once=2)
    for _ in range(16):
        cost.observe(16, 2 * 16 * 0.0086, at_once=2)
        cost.observe(8, 2 * 8 * 0.0095, at_once=2)
    assert cost.choice.batch_limit == 7
    # Once 8 callers' runs are older than the graph's last STALE_RUNS, today's curve decides: the maximum.
    for _ in range(STALE_RUNS // 2):
        cost.observe(16, 2 * 16 * 0.0086, at_once=2)
        cost.observe(8, 2 * 8 * 0.0095, at_once=2)
    assert cost.per_row_seconds() == pytest.approx({3: 0.0095, 4: 0.0086})
    assert cost.choice.batch_limit == 32


def one_caller_then_thirty_two(load: bool) -> GraphCost:
    """MobileNetV2 as measured: one caller's one-row runs alone, 12.9 ms; then 32 callers, its batches alone of 8
    and 16 rows, 13.8 and 12.7 ms a row (the loads given when ``load``)."""
    cost = GraphCost(max_batch_size=32, workers=1)
    for _ in range(3 * DECIDE_EVERY):
        cost.observe(1, 0.0129, waiting=1, load=1 if load else 0)
    for _ in range(3 * DECIDE_EVERY):
        cost.observe(16, 16 * 0.0127, waiting=28, load=31 if load else 0)
        cost.observe(8, 8 * 0.0138, waiting=12, load=30 if load else 0)
    return cost


def test_a_knee_is_chosen_on_runs_of_about_the_load_now():
    # Among the graph's last STALE_RUNS runs, one caller's one-row runs come within 2% of the 16-row ones at 32
    # callers (their host was quieter), and the limit falls to 1 row, at the load where batches serve the most.
    assert one_caller_then_thirty_two(load=False).choice.batch_limit == 1
    # Each run's load (its graph's rows in the scheduler when its batch was taken) tells them apart: the runs of
    # one caller stop counting at 32 callers' load, and the curve there decides: the maximum.
    cost = one_caller_then_thirty_two(load=True)
    assert cost.per_row_seconds() == pytest.approx({3: 0.0138, 4: 0.0127})
    assert cost.choice.batch_limit == 32
    # Back at one caller, its one-row runs alone count, and 32 callers' do not.
    for _ in range(2 * DECIDE_EVERY):
        cost.observe(1, 0.0129, waiting=1, load=1)
    assert cost.per_row_seconds() == pytest.approx({0: 0.0129})
    # A run of an unknown load (0) counts at any load.
    for _ in range(3):
        cost.observe(16, 16 * 0.0127)
    assert cost.per_row_seconds() == pytest.approx({0: 0.0129, 4: 0.0127})


def test_runs_that_share_the_cores_are_compared_by_the_time_the_cores_gave_them():
    # One caller: one-row runs alone on every core, 10 ms each. Then more callers: two runs at once, each of 4
    # rows taking 64 ms where alone it would take 32 (8 ms a row): 16 ms a row of wall time.
    cost = GraphCost(max_batch_size=32, workers=1)
    for _ in range(16):
        cost.observe(1, 0.010)
    assert cost.choice == Choice(True, 1, 3)
    shared = GraphCost(max_batch_size=32, workers=1)
    for _ in range(16):
        shared.observe(1, 0.010)
    for _ in range(4 * DECIDE_EVERY):
        cost.observe(4, 0.064)  # as if alone
        shared.observe(4, 0.064, at_once=2)
    # Taken as its own, a 4-row batch looks slower per row than one row: the limit falls to 1 row.
    assert cost.choice.batch_limit == 1
    # Divided by the runs at once, it is 8 ms a row against 10: batches stay, and may grow a bucket beyond 4-7 rows
    # (larger ones were not seen yet, and may be cheaper still).
    assert shared.per_row_seconds(shared=False) == {0: 0.010}
    assert shared.per_row_seconds() == shared.per_row_seconds(shared=True) == {2: 0.008}
    assert shared.choice == Choice(True, 1, 15)


def test_the_knee_is_chosen_on_runs_of_the_kind_the_graph_runs_now():
    # As measured on MobileNetV2 going from 1 caller to 8 on 2 cores: one row alone 27.6 ms; two runs at once give
    # 21.6 ms a row at 1 row, 17.0 at 3, 15.6 at 4 (each divided by the two); and runs alone (a trial's) take
    # 18.1 ms a row at 4 rows. In one window, 4 rows' median (half alone, half shared) came within 2% of 3 rows'
    # and the limit fell to 3 rows, the wrong way for the load that came.
    cost = GraphCost(max_batch_size=32, workers=1)
    for _ in range(16):
        cost.observe(1, 0.0276)
    for _ in range(2 * DECIDE_EVERY):
        cost.observe(1, 2 * 0.0216, at_once=2)
        cost.observe(3, 2 * 3 * 0.0170, at_once=2)
        cost.observe(4, 2 * 4 * 0.0156, at_once=2)
        cost.observe(4, 4 * 0.0181)  # alone
    assert cost.per_row_seconds() == pytest.approx({0: 0.0216, 1: 0.0170, 2: 0.0156})
    assert cost.per_row_seconds(shared=False) == pytest.approx({0: 0.0276, 2: 0.0181})
    assert cost.choice.compute_bound and cost.choice.batch_limit == 15  # the curve falls to 4-7 rows: 8-15 next
    # Then the runs go alone (one at a time, as a trial may choose): their own curve decides, flat from 4 rows on.
    for _ in range(2 * DECIDE_EVERY):
        cost.observe(8, 8 * 0.0181)
        cost.observe(16, 16 * 0.0181)
    assert cost.per_row_seconds() == pytest.approx({0: 0.0276, 2: 0.0181, 3: 0.0181, 4: 0.0181})
    assert cost.choice.batch_limit == 7


def test_a_bucket_grown_into_is_left_at_its_first_measure_where_the_curve_turned_up_there():
    # ResNet-50 at 32 callers, two runs at once: 8-15 rows the best seen, so the limit grows to the maximum; its
    # batches of 16-31 rows then cost 14% more a row, and the limit falls back to 15 at the next decision, without
    # the three confirmations a limit moved by noise in a known curve needs (24 runs of over a second each).
    changes = []
    cost = GraphCost(max_batch_size=32, workers=1, on_change=changes.append)
    for _ in range(DECIDE_EVERY):
        cost.observe(1, 0.108, load=32)
        cost.observe(12, 12 * 0.0914, load=32)
    assert cost.choice == Choice(True, 1, 32)
    for _ in range(DECIDE_EVERY // 2):
        cost.observe(16, 16 * 0.104, load=32)
        cost.observe(20, 20 * 0.104, load=32)
    assert cost.choice == Choice(True, 1, 15)
    assert [c.batch_limit for c in changes] == [32, 15]


def test_a_bucket_grown_into_is_judged_at_its_third_run_not_at_the_next_decision():
    # The climb from one row to the maximum, three runs a bucket (not a decision every DECIDE_EVERY runs: ResNet-50's
    # climb at 32 callers took 17 s of runs of up to a second that way), and the fall from a bucket that turned up.
    changes = []
    cost = GraphCost(max_batch_size=32, workers=1, on_change=changes.append)
    falling = lambda rows: 0.05 * rows**0.5  # noqa: E731
    for rows, limit in ((1, 3), (2, 7), (4, 15), (8, 32)):
        for _ in range(3):
            cost.observe(rows, falling(rows), load=32)
        assert cost.choice.batch_limit == limit, rows
    assert [c.batch_limit for c in changes] == [3, 7, 15, 32]
    assert DECIDE_EVERY > 3  # (deciding every DECIDE_EVERY runs, 7 would still be the limit here)
    for _ in range(3):
        cost.observe(20, 20 * 0.05 * 8**0.5 * 1.14, load=32)  # 16-31 rows: 14% dearer a row than 8-15
    assert cost.choice.batch_limit == 15 and len(changes) == 5


def test_a_dip_one_bucket_beyond_does_not_stop_the_climb():
    # ResNet-50 on one host, in process: a row costs as much in a batch of 2 as of 1, and 25% less from 16 up. The
    # curve is seen two buckets beyond its knee before the limit stops growing: 2-3 rows no cheaper, 4-7 cheaper.
    cost, limits = GraphCost(max_batch_size=32, workers=1), []
    dip = [0.0637, 0.0658, 0.055, 0.056, 0.0495, 0.0495]  # a row's time by bucket
    for n in range(12 * DECIDE_EVERY):
        rows = 1 if n < 3 else min(cost.choice.batch_limit, 30)  # 30 callers' rows queued
        cost.observe(rows, rows * dip[bucket(rows)], load=32)
        limits.append(cost.choice.batch_limit)
    assert limits[-1] == 32 and 7 in limits and 1 not in limits[3:]
    # Where the rows beyond the knee cost more two buckets on (8-15 and 16-31 against 4-7), the limit falls back.
    for _ in range(3 * DECIDE_EVERY):
        cost.observe(4, 4 * 0.045, load=32)
        cost.observe(12, 12 * 0.052, load=32)
        cost.observe(20, 20 * 0.055, load=32)
    assert cost.choice.batch_limit == 7


def test_no_trial_of_runs_at_once_begins_while_the_limit_grows_into_the_rows_queued():
    # A compute-bound graph under load (two runs at once by default): its first runs, of up to 3 rows with 30 queued,
    # grow the limit; a trial of one run at a time begins only once the curve was seen beyond its knee.
    cost = GraphCost(max_batch_size=32, workers=1, compute_runs=2)
    t = 0.0
    falling = lambda rows: 0.05 * rows**0.5  # noqa: E731

    def run(rows: int, waiting: int, load: int = 32) -> None:
        nonlocal t
        t += falling(rows)
        cost.observe(rows, falling(rows), at_once=2, waiting=waiting, ended=t, load=load)

    for n in range(40):
        run(1 if n < 3 else min(cost.choice.batch_limit, 30), 30)  # its first: one request alone
        assert not cost.runs.trying or cost.choice.batch_limit >= 30
    assert cost.choice.batch_limit == 32 and cost.choice.compute_bound
    # Nor where the other run holds the rows: of two runs at once at 32 callers, one takes the limit's rows, the
    # other the few left (2 queued, its load the other run's rows and its own).
    cost = GraphCost(max_batch_size=32, workers=1, compute_runs=2)
    for n in range(60):
        limit = cost.choice.batch_limit
        if n < 3 or n % 2:
            run(1 if n < 3 else min(limit, 30), 30)
        else:
            run(2, 2, load=2 + min(limit, 30))
        assert not cost.runs.trying or cost.choice.batch_limit >= 30
    assert cost.choice.batch_limit == 32
    # Where the batches no longer fill up to the limit (the load, not the limit, sets their size), trials go on.
    cost = GraphCost(max_batch_size=32, workers=1, compute_runs=2)
    for n in range(40):
        run(1 if n < 3 else min(cost.choice.batch_limit, 2), 2, load=4)
    assert cost.choice.batch_limit == 7 and cost.runs.trying


def test_a_knee_taken_at_one_load_does_not_hold_the_limit_when_the_load_rises():
    # An encoder at 8 callers, two runs at once: batches of 3-4 rows, now and then all 8, and 2-3 rows within 2% of
    # 4-7 (mostly 4) and 8-15: seen flat two buckets beyond it, 3 rows is the knee.
    cost = GraphCost(max_batch_size=32, workers=1)
    for _ in range(4 * DECIDE_EVERY):
        cost.observe(1, 2 * 0.00856, at_once=2, load=8)
        cost.observe(3, 2 * 3 * 0.00543, at_once=2, load=8)
        cost.observe(4, 2 * 4 * 0.00535, at_once=2, load=8)
        cost.observe(8, 2 * 8 * 0.00550, at_once=2, load=8)
    assert cost.choice == Choice(True, 1, 3)
    # Then 32 callers: 8 callers' runs stop counting, and the curve at this load, 3-row batches only, grows the
    # limit a bucket at a time while it falls (as it does: 4.6 ms a row at 4-7 rows, 4.2 at 8-15).
    for _ in range(DECIDE_EVERY):
        cost.observe(3, 2 * 3 * 0.0052, at_once=2, load=32)
    assert cost.choice == Choice(True, 1, 7)
    for _ in range(DECIDE_EVERY):
        cost.observe(7, 2 * 7 * 0.0046, at_once=2, load=32)
    assert cost.choice == Choice(True, 1, 15)
    for _ in range(DECIDE_EVERY):
        cost.observe(15, 2 * 15 * 0.0042, at_once=2, load=32)
    assert cost.choice == Choice(True, 1, 32)


def test_a_trial_of_runs_at_once_neither_moves_the_limit_nor_tells_the_kind():
    # Two runs at once by default; under load a trial runs phases of one run at a time, whose runs go alone: they
    # count in the alone curve, but the graph's kind and its limit wait for the trial's end.
    cost = GraphCost(max_batch_size=32, workers=1, compute_runs=2)
    now = 0.0
    for _ in range(4):
        cost.observe(1, 0.010, ended=(now := now + 0.010))
    while not cost.runs.trying:  # the load rises: batches of 4 rows, two at once
        cost.observe(4, 2 * 4 * 0.008, at_once=2, waiting=8, ended=(now := now + 0.032))
        assert now < 1
    assert cost.choice == Choice(True, 2, 15)  # 4-7 rows seen, the curve falling: up to 8-15
    for _ in range(5 * DECIDE_EVERY):  # a flat curve alone, which would take the limit to 1 row
        cost.observe(4, 4 * 0.010, waiting=8, ended=(now := now + 0.010))
    assert cost.runs.trying
    assert cost.per_row_seconds(shared=False) == {0: 0.010, 2: 0.010}
    assert cost.per_row_seconds() == {2: 0.008}  # the kind told before the trial
    assert cost.choice == Choice(True, 2, 15)


def test_choices_are_made_every_few_runs_and_reported_once_each():
    seen = []
    cost = GraphCost(max_batch_size=32, workers=2, on_change=seen.append)
    for _ in range(3):
        cost.observe(1, 0.05)  # the first three runs decide: compute-bound, batches up to 2-3 rows
    assert seen == [Choice(True, 1, 3)]
    for _ in range(DECIDE_EVERY * 3):
        cost.observe(1, 0.05)
    assert len(seen) == 1  # nothing changed
    for _ in range(DECIDE_EVERY * 3):
        cost.observe(1, 0.0001)
    assert seen[-1].compute_bound is False and len(seen) == 2


@pytest.mark.parametrize(
    "batched, alone, agree",
    [
        ([np.float32([1.0, 2.0])], [np.float32([1.0, 2.0000005])], True),  # another summation order
        ([np.float32([1.0, 2.0])], [np.float32([1.0, 2.1])], False),  # rows mixed
        ([np.float32([100.0, 1e-6])], [np.float32([100.0, 2e-6])], True),  # tiny next to the output's scale
        ([np.float32([np.nan, 1.0])], [np.float32([np.nan, 1.0])], True),
        ([np.int64([3, 4])], [np.int64([3, 5])], False),
        ([np.array([b"a", b"b"], dtype=object)], [np.array([b"a", b"b"], dtype=object)], True),
        ([np.array([b"a"], dtype=object)], [np.array([b"c"], dtype=object)], False),
        ([np.float32([[1.0]])], [np.float32([1.0])], False),  # shapes differ
        ([np.float32([1.0])], [np.float64([1.0])], False),  # dtypes differ
        ([np.float32([1.0])], [np.float32([1.0]), np.float32([1.0])], False),  # outputs missing
    ],
)
def test_answers_agree_within_rounding_only(batched, alone, agree):
    assert answers_agree(batched, alone) is agree


def test_bfloat16_answers_agree_within_its_precision():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.array([1.0, 2.0], dtype=ml_dtypes.bfloat16)
    b = np.array([1.0, 2.015625], dtype=ml_dtypes.bfloat16)  # one step of bfloat16 at 2
    assert answers_agree([a], [b])
    assert not answers_agree([a], [np.array([1.0, 2.5], dtype=ml_dtypes.bfloat16)])


def test_noise_does_not_flip_the_choice():
    rng = np.random.default_rng(0)
    changes = []
    # A call-bound graph whose runs are now and then slowed 20-fold (the event loop took the core).
    cost = GraphCost(max_batch_size=32, workers=1, on_change=changes.append)
    for i in range(2000):
        rows = int(rng.choice(SIZES))
        cost.observe(rows, (0.0002 if i % 7 else 0.004) * (1 + 0.001 * rows))
    assert changes == [] and not cost.choice.compute_bound  # call-bound from the start, and it stays
    # A compute-bound graph whose times jitter by a few percent keeps its batch limit.
    changes.clear()
    cost = GraphCost(max_batch_size=32, workers=1, on_change=changes.append)
    for _ in range(2000):
        rows = int(rng.choice(SIZES))
        cost.observe(rows, (0.012 + 0.047 * rows) * rng.uniform(0.97, 1.03))
    # A first limit while only small batches were seen, then the knee (8-15 rows, 2.3% over the best: at the edge
    # of the 2% tolerance) and at most one flip back and forth.
    assert cost.choice.compute_bound and len(changes) <= 4


def test_only_one_row_runs_say_whether_a_graph_is_compute_bound():
    # Under load a call-bound graph's batches take long in wall time (the event loop has the core meanwhile).
    cost = GraphCost(max_batch_size=32, workers=2)
    feed(cost, lambda rows: 0.0002 if rows == 1 else 0.003, (1, 8, 16))
    assert not cost.choice.compute_bound
    cost = GraphCost(max_batch_size=32, workers=2)
    feed(cost, lambda rows: 0.003, (8, 16))  # no one-row run yet: nothing to say, the choice stays
    assert not cost.choice.compute_bound and cost.choice.concurrency == 2


def test_one_row_runs_slowed_by_load_do_not_make_a_call_bound_graph_compute_bound():
    # Under 32 callers most of a small MLP's one-row runs wait for the core (the event loop, the other runs): their
    # median is past the threshold, but the fastest of them is the graph's own cost.
    changes = []
    cost = GraphCost(max_batch_size=32, workers=2, on_change=changes.append)
    for i in range(400):
        cost.observe(1, 0.0002 if i % 3 == 0 else COMPUTE_BOUND_SECONDS * 3)
        cost.observe(32, 0.0004)
    assert changes == [] and not cost.choice.compute_bound and cost.choice.concurrency == 2
    # A graph whose every one-row run is slow is compute-bound, however its batches go.
    cost = GraphCost(max_batch_size=32, workers=2)
    feed(cost, lambda rows: COMPUTE_BOUND_SECONDS * 3 if rows == 1 else 0.0004, (1, 32))
    assert cost.choice.compute_bound and cost.choice.concurrency == 1


def test_a_graph_whose_runs_go_on_one_thread_runs_in_lanes_however_fast_its_rows():
    # A GRU on XLA's programs: 1.1 ms a row, under the compute-bound threshold, but on one thread: each run keeps
    # one core, so it runs in lanes, one per core of its version's pool. On its version's session it is call-bound.
    fast = 0.55 * COMPUTE_BOUND_SECONDS
    cost = GraphCost(max_batch_size=32, workers=1, threads=2, compute_runs=2)
    for i in range(2 * DECIDE_EVERY):
        rows = 1 << (i % 4)
        cost.observe(rows, fast * rows**0.5, one_thread=True)
    assert cost.choice == Choice(True, 2, 32, 1) and cost.in_lanes()
    other = GraphCost(max_batch_size=32, workers=1, threads=2, compute_runs=2)
    for i in range(2 * DECIDE_EVERY):
        rows = 1 << (i % 4)
        other.observe(rows, fast * rows**0.5)
    assert other.choice == Choice(False, 1, 32, 2) and not other.in_lanes()
    # On XLA's programs while its batch sizes compile: most runs still in its version's session (no program for
    # their size yet), yet it stays in lanes.
    compiling = GraphCost(max_batch_size=32, workers=1, threads=2, compute_runs=2)
    for i in range(2 * DECIDE_EVERY):
        rows = 1 << (i % 4)
        compiling.observe(rows, fast * rows**0.5 * (1 if i % 4 == 0 else 3), one_thread=i % 4 == 0, compiled=True)
    assert compiling.choice == Choice(True, 2, 32, 1) and compiling.in_lanes()
