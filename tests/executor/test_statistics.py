"""executor/statistics.py: Triton's per-version figures add up exactly, from several threads at once."""

from __future__ import annotations

import threading

from servex.executor.statistics import ModelStatistics, statistics


def test_figures_add_up_from_concurrent_threads():
    stats = ModelStatistics()

    def work():
        for _ in range(2000):
            stats.waited(0.001)
            stats.ran(2, 3, 0.002)  # a run of two requests, three rows
            stats.answered(True, 0.004, 0.0005, 0.0002)  # its tensors decoded in 0.5 ms, encoded in 0.2
            stats.answered(False, 0.001, 0.0005)  # a failure's decoding is not counted

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    f = stats.snapshot()
    assert (f.inference_count, f.execution_count) == (4 * 2000 * 3, 4 * 2000)
    assert f.queue.count == 8000 and abs(f.queue.ns - 8000 * 1_000_000) <= 8000
    assert f.compute_infer.count == 16000  # per request: each of the run's two
    assert abs(f.compute_infer.ns - 16000 * 2_000_000) <= 16000
    assert (f.success.count, f.fail.count) == (8000, 8000)
    assert f.compute_input.count == 8000 and abs(f.compute_input.ns - 8000 * 500_000) <= 8000
    assert f.compute_output.count == 8000 and abs(f.compute_output.ns - 8000 * 200_000) <= 8000
    assert list(f.batches) == [2] and f.batches[2].count == 8000
    assert f.last_inference_ms > 0


def test_untimed_decoding_and_encoding_are_not_counted():
    stats = ModelStatistics()
    stats.answered(True, 0.004)  # an adapter that does not time them (SessionRun, say)
    stats.answered(True, 0.004, 0.001)
    f = stats.snapshot()
    assert (f.success.count, f.compute_input.count, f.compute_output.count) == (2, 1, 0)


def test_a_snapshot_does_not_move_with_later_figures():
    stats = ModelStatistics()
    stats.ran(1, 1, 0.5)
    before = stats.snapshot()
    stats.ran(4, 4, 0.5)
    assert (before.execution_count, list(before.batches)) == (1, [1])
    assert stats.snapshot().execution_count == 2


def test_one_object_per_model_version():
    assert statistics("m", "1") is statistics("m", "1")
    assert statistics("m", "1") is not statistics("m", "2")
