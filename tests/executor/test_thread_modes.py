"""The ThreadModeChooser on given run times: which mode a client graph's lone runs keep. No timing."""

from __future__ import annotations

from servex.executor.thread_modes import (
    BUSY_RUNS,
    ONE_THREAD,
    ONE_THREAD_BUSY,
    POOL,
    POOL_BUSY_SHARE,
    WORKER,
    XLA,
    XLA_BUSY,
    ThreadModeChooser,
)

MODES = (WORKER, POOL, ONE_THREAD)


def chosen(
    seconds: dict[str, float], rows: int = 1, busy: float = 1.2, cores: int | None = None, ungated=()
) -> tuple[str | None, list[str]]:
    """Run a ThreadModeChooser of ``seconds``' modes to its decision on fixed run times, its worker's runs keeping
    ``busy`` of ``cores`` cores busy (None: not known); its choice and the modes it tried, in order."""
    chooser, tried = decided(seconds, rows, busy, cores, ungated)
    return chooser.mode, tried


def decided(
    seconds: dict[str, float], rows: int = 1, busy: float = 1.2, cores: int | None = None, ungated=()
) -> tuple[ThreadModeChooser, list[str]]:
    """``chosen``'s chooser once decided, and the modes it tried."""
    chooser = ThreadModeChooser("g", tuple(seconds), cores, ungated=ungated)
    tried = []
    for _ in range(2 * chooser.runs):
        if chooser.mode is not None:
            break
        mode = chooser.pick()
        tried.append(mode)
        chooser.record(mode, rows, seconds[mode], busy if mode == WORKER else None)
    return chooser, tried


def test_a_small_graph_stays_on_its_worker_after_one_run():
    assert chosen({WORKER: 0.0002, POOL: 0.0001, ONE_THREAD: 0.0001}) == (WORKER, [WORKER])


def test_a_compute_bound_graph_tries_each_mode_in_turns_and_keeps_the_fastest():
    mode, tried = chosen({WORKER: 0.012, POOL: 0.013, ONE_THREAD: 0.010})  # encoder-like
    assert mode == ONE_THREAD
    # One thread joins once the worker's first runs showed the cores it keeps busy.
    assert tried[: 2 * BUSY_RUNS] == [WORKER, POOL] * BUSY_RUNS and tried[2 * BUSY_RUNS] == ONE_THREAD
    each = ThreadModeChooser.WARM + ThreadModeChooser.TRIALS
    assert tried.count(ONE_THREAD) == each and tried.count(WORKER) >= each and tried.count(POOL) >= each
    assert chosen({WORKER: 0.018, POOL: 0.015})[0] == POOL  # MobileNetV2-like, without a second session
    assert chosen({WORKER: 0.054, POOL: 0.053, ONE_THREAD: 0.071})[0] == WORKER  # ResNet-50-like: within 5%
    assert chosen({WORKER: 0.060, POOL: 0.053, ONE_THREAD: 0.071})[0] == POOL


def test_one_thread_is_not_tried_where_the_worker_keeps_the_cores_busy():
    # ResNet-50-like: its ops use both cores, and one thread would take far longer; its trial runs are spared.
    mode, tried = chosen({WORKER: 0.054, POOL: 0.053, ONE_THREAD: 0.071}, busy=1.8)
    assert mode == WORKER and ONE_THREAD not in tried
    assert chosen({WORKER: 0.012, POOL: 0.013, ONE_THREAD: 0.010}, busy=ONE_THREAD_BUSY + 0.1)[0] == WORKER
    # Until the worker's runs were measured (none yet where a callable was being made beside them), no choice.
    chooser = ThreadModeChooser("g", MODES)
    for _ in range(3 * chooser.runs):
        chooser.record(WORKER, 1, 0.020)
        chooser.record(POOL, 1, 0.015)
    assert chooser.mode is None and chooser.gated
    for _ in range(BUSY_RUNS):
        chooser.record(WORKER, 1, 0.020, busy=1.9)
    assert chooser.mode == POOL and not chooser.gated


def test_the_pool_is_tried_only_where_the_workers_runs_leave_cores_idle():
    # ResNet-50-like on 2 cores: its lone runs keep 1.8 busy, and the pool (which came within 4% wherever runs kept
    # 1.5 cores or more busy) is not tried, nor its callable made: the worker after its own runs alone.
    mode, tried = chosen({WORKER: 0.054, POOL: 0.053, ONE_THREAD: 0.071}, busy=1.8, cores=2)
    assert mode == WORKER and tried == [WORKER] * (ThreadModeChooser.WARM + ThreadModeChooser.TRIALS)
    # A GRU-like graph keeps one core busy: the pool joins the trial once that was measured, and may win.
    mode, tried = chosen({WORKER: 0.0031, POOL: 0.0024}, busy=1.0, cores=2)
    assert mode == POOL and tried[:BUSY_RUNS] == [WORKER] * BUSY_RUNS and POOL in tried
    # The line is a share of the cores: on 16, a run that keeps 8 busy leaves room for the pool's branches.
    assert chosen({WORKER: 0.054, POOL: 0.040}, busy=8.0, cores=16)[0] == POOL
    assert chosen({WORKER: 0.054, POOL: 0.040}, busy=POOL_BUSY_SHARE * 16 + 0.1, cores=16)[0] == WORKER


def test_runs_under_load_go_on_one_thread_where_it_beat_the_worker_whichever_mode_runs_alone():
    # MobileNetV2-like on one host: the pool a little faster alone than one thread, both faster than the worker.
    # Alone its runs take the pool; under load one thread each, several at once (lanes).
    chooser, _ = decided({WORKER: 0.0193, POOL: 0.0172, ONE_THREAD: 0.0178})
    assert (chooser.mode, chooser.under_load) == (POOL, ONE_THREAD)
    chooser, _ = decided({WORKER: 0.0193, XLA: 0.0095, ONE_THREAD: 0.0178}, ungated=(XLA,))
    assert (chooser.mode, chooser.under_load) == (XLA, ONE_THREAD)
    # One thread within its gain of the worker: under load on the worker, as the runs alone of a graph that kept it.
    for seconds in ({WORKER: 0.0185, POOL: 0.0172, ONE_THREAD: 0.0178}, {WORKER: 0.0193, POOL: 0.0172}):
        chooser, _ = decided(seconds)
        assert (chooser.mode, chooser.under_load) == (POOL, WORKER)
    chooser, _ = decided({WORKER: 0.0193, POOL: 0.0190, ONE_THREAD: 0.0160})
    assert chooser.mode == ONE_THREAD


def test_another_mode_must_save_its_gain():
    # A tie stays on the worker, which hands nothing over and holds no second session.
    assert chosen({WORKER: 0.020, POOL: 0.0195, ONE_THREAD: 0.0193})[0] == WORKER
    assert chosen({WORKER: 0.020, POOL: 0.0195, ONE_THREAD: 0.0185})[0] == ONE_THREAD


def test_each_modes_first_runs_are_left_out():
    # An encoder-like graph: a callable's first runs are slow, the one-thread one's more so, while warm it is
    # faster by a fifth. Counted, the first runs would keep it on its worker.
    chooser = ThreadModeChooser("g", (WORKER, ONE_THREAD))
    runs = {WORKER: 0, ONE_THREAD: 0}
    while chooser.mode is None and sum(runs.values()) < 2 * chooser.runs:
        mode = chooser.pick()
        cold = runs[mode] < ThreadModeChooser.WARM
        runs[mode] += 1
        fast = mode == ONE_THREAD
        seconds = (0.020 if fast else 0.013) if cold else (0.010 if fast else 0.0123)
        chooser.record(mode, 1, seconds, 1.1 if mode == WORKER else None)
    assert chooser.mode == ONE_THREAD
    assert runs[ONE_THREAD] == chooser.runs // 2 and runs[WORKER] >= chooser.runs // 2


def test_runs_of_other_batch_sizes_are_not_compared():
    chooser = ThreadModeChooser("g", (WORKER, POOL))
    for _ in range(chooser.runs):
        chooser.record(WORKER, 1, 0.010)
        chooser.record(POOL, 8, 0.040)  # per row far less, but at another size
    assert chooser.mode is None


def test_a_mode_that_cannot_be_had_is_dropped():
    # The one-thread session could not be made (no memory, or the version's variables were given new values):
    # the others decide alone, at once where they have been seen enough.
    chooser = ThreadModeChooser("g", MODES)
    for _ in range(ThreadModeChooser.WARM + ThreadModeChooser.TRIALS):
        chooser.record(WORKER, 1, 0.020, busy=1.2)
        chooser.record(POOL, 1, 0.015)
    assert chooser.mode is None and not chooser.gated  # still waiting for the one-thread runs
    chooser.drop(ONE_THREAD)
    assert chooser.mode == POOL and chooser.modes == [WORKER, POOL]
    alone = ThreadModeChooser("g", (WORKER, ONE_THREAD))
    alone.drop(ONE_THREAD)
    assert alone.mode == WORKER
    alone.drop(WORKER)  # the worker is always there
    assert alone.modes == [WORKER]


def test_runs_in_a_dropped_mode_are_not_counted():
    chooser = ThreadModeChooser("g", MODES)
    chooser.drop(POOL)
    for _ in range(3 * chooser.runs):
        chooser.record(POOL, 1, 0.001)  # a run that was already under way in it
    assert chooser.mode is None


def test_xla_is_kept_where_faster_and_dropped_at_its_first_run_much_slower():
    # A GRU-like graph: XLA's program took 1.1 ms where its worker took 3.2; its program is warmed where it is
    # compiled, so its runs count from the first (the others' first WARM do not).
    mode, tried = chosen({WORKER: 0.0032, POOL: 0.0037, XLA: 0.0011}, busy=1.0)
    assert mode == XLA and tried.count(XLA) >= ThreadModeChooser.TRIALS
    assert tried.count(WORKER) == ThreadModeChooser.WARM + ThreadModeChooser.TRIALS
    # 86 ms compiled against 22 on its worker: one run of it, then the others decide.
    mode, tried = chosen({WORKER: 0.022, POOL: 0.021, XLA: 0.086}, busy=1.0)
    assert mode == WORKER and tried.count(XLA) == 1
    # Where its worker's lone runs keep the cores busy (ResNet-50-like), XLA is not tried, nor compiled for.
    mode, tried = chosen({WORKER: 0.054, POOL: 0.053, ONE_THREAD: 0.071, XLA: 0.030}, busy=1.8)
    assert mode == WORKER and XLA not in tried and ONE_THREAD not in tried


def test_one_thread_is_dropped_after_its_first_runs_much_slower():
    # Let in where its lone runs read 1.55 cores busy, 1.6x slower on one thread: its warm runs and two more, then the
    # others decide without it.
    mode, tried = chosen({WORKER: 0.050, POOL: 0.051, ONE_THREAD: 0.080}, busy=1.55)
    assert mode == WORKER and tried.count(ONE_THREAD) == ThreadModeChooser.WARM + 2
    assert chosen({WORKER: 0.050, POOL: 0.051, ONE_THREAD: 0.069}, busy=1.55)[1].count(ONE_THREAD) == (
        ThreadModeChooser.WARM + ThreadModeChooser.TRIALS
    )  # DenseNet-121-like, 1.38x: tried in full (a faster graph's first runs read as much on a noisy host)
    # One slow run of the two (a noisy host) does not end the trial of a mode that is faster.
    chooser = ThreadModeChooser("g", (WORKER, ONE_THREAD))
    one_thread = iter([0.020] * ThreadModeChooser.WARM + [0.030] + [0.010] * ThreadModeChooser.TRIALS)
    while chooser.mode is None:
        mode = chooser.pick()
        chooser.record(mode, 1, next(one_thread) if mode == ONE_THREAD else 0.013, 1.5 if mode == WORKER else None)
    assert chooser.mode == ONE_THREAD


def test_one_lucky_worker_run_does_not_end_another_modes_trial():
    # A noisy host: one of the worker's runs took 8.0 ms, the others 14.0; one thread's took 15.0, within 1.5x of the
    # worker's typical run (its median), if not of its fastest: tried in full, and the worker kept (no gain).
    chooser, tried = ThreadModeChooser("g", (WORKER, ONE_THREAD)), []
    worker = iter([0.008] + [0.014] * 100)
    while chooser.mode is None and len(tried) < 100:
        mode = chooser.pick()
        tried.append(mode)
        chooser.record(mode, 1, next(worker) if mode == WORKER else 0.015, 1.5 if mode == WORKER else None)
    assert chooser.mode == WORKER
    assert tried.count(ONE_THREAD) == ThreadModeChooser.WARM + ThreadModeChooser.TRIALS


def test_one_thread_is_tried_below_the_busy_line_only():
    # MobileNetV2-like on one host: its lone runs on its worker kept 1.51 cores busy, and one thread was faster.
    assert chosen({WORKER: 0.018, POOL: 0.019, ONE_THREAD: 0.014}, busy=1.51)[0] == ONE_THREAD
    assert chosen({WORKER: 0.018, POOL: 0.019, ONE_THREAD: 0.014}, busy=ONE_THREAD_BUSY)[0] == WORKER


def test_xla_must_save_more_than_the_other_modes():
    # 6% faster compiled (the encoder once, by the host's noise): its worker keeps it, batch sizes are not compiled.
    times = {WORKER: 0.0121, POOL: 0.0125, ONE_THREAD: 0.0120, XLA: 0.0113}
    assert chosen(times, busy=1.2)[0] == WORKER
    # 27% faster (the encoder on another host: 6.9 ms a row against 9.5 on its worker, 8.7 on one thread): not XLA's.
    assert chosen({WORKER: 0.0095, POOL: 0.0097, ONE_THREAD: 0.0087, XLA: 0.0069}, busy=1.2)[0] == ONE_THREAD
    assert chosen({WORKER: 0.0095, POOL: 0.0097, ONE_THREAD: 0.0094, XLA: 0.0069}, busy=1.2)[0] == WORKER
    assert chosen({**times, XLA: 0.0066}, busy=1.2)[0] == XLA  # 45% faster (a GRU's saved 50-76%)
    # One thread's smaller gain still counts against XLA's larger one.
    assert chosen({**times, ONE_THREAD: 0.0090, XLA: 0.0066}, busy=1.2)[0] == ONE_THREAD


def test_xla_is_tried_below_its_own_busy_line():
    # The encoder on one host: its lone runs kept 1.54-1.73 cores busy; one thread is tried there, XLA's program (one
    # thread too, and the dearest trial) only below XLA_BUSY, where a GRU's 1.00-1.04 and that host's 1.06-1.25 read.
    times = {WORKER: 0.0088, POOL: 0.0087, ONE_THREAD: 0.0110, XLA: 0.0045}
    mode, tried = chosen(times, busy=XLA_BUSY + 0.1)
    assert mode == WORKER and ONE_THREAD in tried and XLA not in tried
    mode, tried = chosen(times, busy=XLA_BUSY - 0.1)
    assert mode == XLA and ONE_THREAD in tried
    assert XLA_BUSY < ONE_THREAD_BUSY


def test_an_ungated_mode_is_tried_from_the_first_runs_whatever_the_cores_kept_busy():
    # A GRU-like loop of tiny ops: its lone runs on its worker read 1.80 cores busy in one start (TensorFlow's threads
    # spinning between ops), over XLA's line, where its program ran 3x faster. Offered ungated (graph_executor.py:
    # a loop), XLA takes turns from the first runs and is kept; gated, it is never tried.
    times = {WORKER: 0.0086, POOL: 0.0090, ONE_THREAD: 0.0085, XLA: 0.0025}
    mode, tried = chosen(times, busy=1.8)
    assert mode == WORKER and XLA not in tried
    mode, tried = chosen(times, busy=1.8, ungated=(XLA,))
    assert mode == XLA and tried[:3] == [WORKER, POOL, XLA] and ONE_THREAD not in tried
    # Below the lines, the gated modes still join once the worker's runs were measured.
    mode, tried = chosen(times, busy=1.2, ungated=(XLA,))
    assert mode == XLA and ONE_THREAD in tried and tried.index(ONE_THREAD) > tried.index(XLA)
    # Ungated but slower: dropped at its first run as before, and the worker kept.
    mode, tried = chosen({**times, XLA: 0.0200}, busy=1.8, ungated=(XLA,))
    assert mode == WORKER and tried.count(XLA) == 1
