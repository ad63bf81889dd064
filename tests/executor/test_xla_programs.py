"""XlaPrograms on given callables (no TensorFlow): compiled per set of feed shapes on the prepare pool, checked
against the session's answer, and run only on integer feeds within what the session answered. No timing."""

from __future__ import annotations

import time

import numpy as np

from servex.executor import xla_programs
from servex.executor.xla_programs import XlaPrograms, disagreement
from servex.loader.variables import RunGate


class Programs:
    """An XlaPrograms over ``program`` (a function of the feeds), counting its calls and its failures."""

    def __init__(self, program):
        self.calls, self.failures = 0, 0

        def counted(*feeds):
            self.calls += 1
            return program(*feeds)

        self.fn = counted
        self.xla = XlaPrograms("g", lambda: self.fn, RunGate(), lambda fn, feeds: fn(*feeds), self.fail)

    def fail(self) -> None:
        self.failures += 1

    def compiled(self, feeds, expected) -> None:
        self.xla.compile(feeds, expected)
        deadline = time.monotonic() + 30
        while self.xla.compiling() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not self.xla.compiling()


def double(*feeds):
    return [2 * feeds[0].astype(np.float32)]


def test_a_program_runs_once_compiled_and_checked_and_only_on_integers_the_session_answered():
    p = Programs(double)
    ids = np.array([[1, 5, 9]], np.int32)
    assert p.xla.run([ids]) is None and not p.xla.ready([ids])  # not compiled yet
    p.xla.served([ids])
    p.compiled([ids], double(ids))
    assert p.calls == 1 + xla_programs.WARM and p.failures == 0
    np.testing.assert_array_equal(p.xla.run([ids])[0], [[2, 10, 18]])
    assert p.xla.ready([np.array([[9, 1, 5]], np.int32)])  # within [1, 9]: answered at both ends
    assert not p.xla.ready([np.array([[0, 5, 9]], np.int32)])  # 0: not yet answered by the session
    assert not p.xla.ready([np.array([[1, 5, 10]], np.int32)])
    assert p.xla.run([np.array([[1, 5, 10]], np.int32)]) is None
    p.xla.served([np.array([[0, 10, 10]], np.int32)])  # the session answered them: the range widens
    assert p.xla.ready([np.array([[0, 5, 10]], np.int32)])
    assert not p.xla.ready([np.array([[1, 5], [2, 3]], np.int32)])  # other shapes: not compiled


def test_a_program_that_answers_otherwise_or_fails_to_compile_is_not_run():
    p = Programs(lambda x: [x + 1.0])
    x = np.ones((1, 4), np.float32)
    p.compiled([x], [x])  # the session answered x, the program x + 1
    assert p.failures == 1 and not p.xla.ready([x]) and p.xla.run([x]) is None

    def broken(x):
        raise RuntimeError("Detected unsupported operations when trying to compile graph")

    p = Programs(broken)
    p.compiled([x], [x])
    assert p.failures == 1 and p.xla.run([x]) is None
    p.compiled([x], [x])  # tried once per set of shapes
    assert p.failures == 1


def test_at_most_a_few_sets_of_shapes_are_compiled():
    p = Programs(double)
    for rows in range(1, xla_programs.MOST + 3):
        x = np.ones((rows, 2), np.float32)
        p.compiled([x], double(x))
    assert p.calls == xla_programs.MOST * (1 + xla_programs.WARM)
    assert p.xla.ready([np.ones((1, 2), np.float32)])
    assert not p.xla.ready([np.ones((xla_programs.MOST + 1, 2), np.float32)])


def test_answers_agree_within_a_relative_tolerance_of_the_largest_value():
    a = np.array([100.0, 1e-6], np.float32)
    assert disagreement([a + np.float32(0.05)], [a]) is None  # 5e-4 of the largest value
    assert "differ" in disagreement([a + np.float32(0.5)], [a])
    assert disagreement([np.array([1, 2])], [np.array([1, 2])]) is None
    assert "differ" in disagreement([np.array([1, 3])], [np.array([1, 2])])
    assert "float32[2]" in disagreement([np.zeros(2, np.float32)], [np.zeros(3, np.float32)])
