"""Batching inputs that differ beyond the 0th dimension: TensorFlow Serving's pad_variable_length_inputs."""

from __future__ import annotations

import numpy as np
import pytest

from servex.executor import batch_runs
from servex.executor.batching import BatchingOptions, pad_to_common_shape
from servex.executor.run_handler import RunHandler
from tests.executor.fakes import batched as queue_batched


class Echo:
    """A GraphExecutor stand-in: run() answers 'x' as it was fed, and records the shape of each run's feed."""

    def __init__(self):
        self.runs: list[tuple[int, ...]] = []

    def run(self, feeds, fetches, targets=(), graph_name="", pin=False, alone=True):
        self.runs.append(feeds["x"].shape)
        return [feeds["x"]]


def batched(values, max_padded_batch_bytes=0, **options):
    batching = BatchingOptions(**{"max_batch_size": 8, **options})
    handler = RunHandler(1, batching=batching, max_padded_batch_bytes=max_padded_batch_bytes)
    executor = Echo()
    try:
        return executor.runs, [result[0] for result in queue_batched(handler, executor, values)]
    finally:
        handler.close()


def test_inputs_of_other_lengths_run_as_one_batch_each_padded_with_its_own_first_element():
    values = [np.array([[1, 2]], np.float32), np.array([[3, 4, 5], [6, 7, 8]], np.float32),
              np.array([[9]], np.float32)]  # fmt: skip
    runs, results = batched(values, pad_variable_length_inputs=True)
    assert runs == [(4, 3)]  # one run of the 4 rows, at the longest length
    np.testing.assert_array_equal(results[0], [[1, 2, 1]])
    np.testing.assert_array_equal(results[1], [[3, 4, 5], [6, 7, 8]])
    np.testing.assert_array_equal(results[2], [[9, 9, 9]])


def test_without_padding_inputs_of_other_lengths_run_apart_at_their_own_length():
    values = [np.array([[1, 2]], np.float32), np.array([[3, 4, 5]], np.float32), np.array([[6, 7]], np.float32)]
    runs, results = batched(values)
    assert runs == [(2, 2), (1, 3)]
    for value, result in zip(values, results, strict=True):
        np.testing.assert_array_equal(result, value)


def test_every_dimension_but_the_0th_is_padded_strings_too():
    values = [np.array([[[b"a", b"b"]]], object), np.array([[[b"c"], [b"d"], [b"e"]]], object)]
    runs, results = batched(values, pad_variable_length_inputs=True)
    assert runs == [(2, 3, 2)]
    assert results[0].tolist() == [[[b"a", b"b"], [b"a", b"a"], [b"a", b"a"]]]
    assert results[1].tolist() == [[[b"c", b"c"], [b"d", b"c"], [b"e", b"c"]]]


def test_padded_inputs_are_then_padded_up_to_an_allowed_batch_size():
    values = [np.array([[1]], np.int64), np.array([[2, 3, 4]], np.int64), np.array([[5, 6]], np.int64)]
    runs, results = batched(values, max_batch_size=4, allowed_batch_sizes=(2, 4), pad_variable_length_inputs=True)
    assert runs == [(4, 3)]
    assert [r.tolist() for r in results] == [[[1, 1, 1]], [[2, 3, 4]], [[5, 6, 5]]]


def test_inputs_of_another_rank_or_dtype_or_without_elements_batch_apart():
    values = [np.ones((1, 2), np.float32), np.ones((1, 2, 1), np.float32), np.ones((1, 3), np.int32),
              np.ones((1, 0), np.float32), np.ones((1, 4), np.float32), np.ones((1, 0), np.float32)]  # fmt: skip
    runs, results = batched(values, pad_variable_length_inputs=True)
    assert runs == [(2, 4), (1, 2, 1), (1, 3), (2, 0)]  # an empty input has no first element to pad with
    assert [r.shape for r in results] == [(1, 4), (1, 2, 1), (1, 3), (1, 0), (1, 4), (1, 0)]


def test_a_request_joins_a_padded_batch_only_while_the_padded_inputs_stay_within_the_bound():
    """Padding one long input's length onto many short ones must not make a batch larger than any request may be:
    a request that would take the padded batch past the bound waits for the next batch."""
    values = [np.ones((1, 2), np.float32), np.ones((1, 1000), np.float32), np.ones((2, 3), np.float32),
              np.ones((1, 900), np.float32)]  # fmt: skip
    runs, results = batched(values, max_padded_batch_bytes=7000, pad_variable_length_inputs=True)
    # [1,2] with [1,1000] would be 2 x 1000 float32s, 8,000 bytes: the [2,3] joins instead, the [1,900] does not
    # (4 x 900 x 4 bytes); then [1,1000] with [1,900] would be 8,000 bytes again: each runs at its own length.
    assert runs == [(3, 3), (1, 1000), (1, 900)]
    assert [r.shape for r in results] == [(1, 3), (1, 1000), (2, 3), (1, 900)]
    runs, _ = batched(values, pad_variable_length_inputs=True)  # no bound
    assert runs == [(5, 1000)]


def test_the_bound_counts_the_strings_padding_copies():
    """A 10 KB string padded over a 2,000-long sequence would be 2,000 copies of it: 20 MB from 10 KB of input.
    (Small enough for asyncio.run, which on Python 3.11 writes out the test's main task, results and all.)"""
    values = [np.array([[b"x" * 10_000]], object), np.array([[b"y"] * 2000], object)]
    runs, results = batched(values, max_padded_batch_bytes=1_000_000, pad_variable_length_inputs=True)
    assert runs == [(1, 1), (1, 2000)]
    assert [r.shape for r in results] == [(1, 1), (1, 2000)]
    runs, _ = batched(values, max_padded_batch_bytes=50_000_000, pad_variable_length_inputs=True)  # counted: 40 MB
    assert runs == [(2, 2000)]


def test_the_bound_counts_the_rows_an_allowed_batch_size_adds():
    values = [np.ones((1, 8), np.float32), np.ones((1, 8), np.float32), np.ones((1, 7), np.float32)]
    # 3 rows of 8 float32s are 96 bytes, run as 4 rows (128 bytes): over a bound of 100
    runs, _ = batched(values, max_padded_batch_bytes=100, max_batch_size=4, allowed_batch_sizes=(4,),
                      pad_variable_length_inputs=True)  # fmt: skip
    assert runs == [(4, 8), (4, 7)]  # the two of length 8 (no padding: not bounded), then the short one alone


def test_the_bound_never_splits_a_batch_that_needs_no_padding():
    """Inputs of one length batch as they would without pad_variable_length_inputs, whatever their size."""
    values = [np.ones((1, 8), np.float32)] * 4
    assert batched(values, max_padded_batch_bytes=100, pad_variable_length_inputs=True)[0] == [(4, 8)]
    assert batched(values, max_padded_batch_bytes=100)[0] == [(4, 8)]


@pytest.mark.parametrize("shapes", [[(1, 3), (2, 3)], [(3,), (1,)]])
def test_parts_already_at_the_common_shape_are_not_copied(shapes):
    parts = [np.zeros(shape, np.float32) for shape in shapes]
    assert all(a is b for a, b in zip(pad_to_common_shape(parts), parts, strict=True))


def test_a_batch_whose_inputs_cannot_be_merged_runs_each_request_alone(monkeypatch):
    """No memory for the padded batch: each caller is still answered (run on its own), and the worker lives on."""

    def no_memory(parts):
        raise MemoryError("padding")

    monkeypatch.setattr(batch_runs, "pad_to_common_shape", no_memory)
    values = [np.array([[1, 2]], np.float32), np.array([[3, 4, 5]], np.float32)]
    handler = RunHandler(1, batching=BatchingOptions(max_batch_size=8, pad_variable_length_inputs=True))
    executor = Echo()
    try:
        results = [result[0] for result in queue_batched(handler, executor, values)]
        later = queue_batched(handler, executor, [np.array([[6]], np.float32)])  # the worker still takes work
    finally:
        handler.close()
    assert executor.runs == [(1, 2), (1, 3), (1, 1)]
    for value, result in zip(values, results, strict=True):
        np.testing.assert_array_equal(result, value)
    assert later[0][0].tolist() == [[6]]
