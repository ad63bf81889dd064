"""MemoryBudget (executor/memory.py): admission against this process's real resident memory and a limit set
around it."""

from __future__ import annotations

import numpy as np
import pytest

from servex.executor.memory import MIN_MARGIN, OUTPUT_COPIES, MemoryBudget
from servex.loader.errors import ResourceExhausted

MiB = 1 << 20


def budget(room: int) -> MemoryBudget:
    """A budget whose usable memory is ``room`` bytes above what this process holds now."""
    b = MemoryBudget()
    usable = b.resident() + room
    b.configure(usable + max(usable // 9, MIN_MARGIN), "a test's limit")  # the margin is a tenth of the limit
    assert abs(b.usable - usable) < 16 * MiB
    return b


def test_without_a_limit_everything_is_admitted_and_nothing_reserved():
    b = MemoryBudget()
    assert b.admit(1 << 40, "run") == 0
    b.check(1 << 40, "message")
    assert b.reserved == 0


def test_admitted_work_is_reserved_until_released():
    b = budget(400 * MiB)
    first = b.admit(100 * MiB, "run")
    second = b.admit(100 * MiB, "run")
    assert (first, second, b.reserved) == (100 * MiB, 100 * MiB, 200 * MiB)
    b.release(first)
    b.release(second)
    assert b.reserved == 0


def test_work_past_the_limit_is_refused_naming_the_limit_and_its_source():
    b = budget(300 * MiB)
    held = b.admit(200 * MiB, "run")
    with pytest.raises(ResourceExhausted) as refused:
        b.admit(200 * MiB, "run", "a run of model 'big' version 1")
    message = refused.value.message
    assert "a run of model 'big' version 1 needs about 200.0 MiB" in message
    assert "200.0 MiB more admitted" in message and "from a test's limit" in message
    assert b.reserved == held  # the refused work reserved nothing
    b.release(held)
    assert b.admit(200 * MiB, "run") == 200 * MiB  # room again once the first is over


def test_check_refuses_as_admit_does_but_keeps_nothing():
    b = budget(100 * MiB)
    b.check(50 * MiB, "message")
    assert b.reserved == 0
    with pytest.raises(ResourceExhausted, match="a message of 1 GiB"):
        b.check(1 << 30, "message", "a message of 1 GiB")


def test_resident_memory_counts_what_the_process_allocates():
    b = MemoryBudget()
    before = b.resident()
    block = np.ones(64 * MiB, np.uint8)
    assert b.resident() - before >= 60 * MiB
    del block


def test_a_run_is_estimated_from_its_inputs_until_its_outputs_are_learned():
    b = budget(100 * MiB)
    feeds = [np.zeros((4, 1000), np.float32)]  # 16,000 bytes, 4 rows
    assert b.run_need("g", feeds) == 16_000 + OUTPUT_COPIES * 16_000
    assert b.run_need("g", feeds, lambda: 40_000) == 16_000 + OUTPUT_COPIES * 160_000  # declared, when larger
    b.learn("g", feeds, [np.zeros((4, 10), np.float32)])  # 40 bytes a row
    assert b.run_need("g", [np.zeros((8, 1000), np.float32)]) == 32_000 + OUTPUT_COPIES * 320
    b.learn("g", feeds, [np.zeros((4, 5), np.float32)])  # smaller: the largest seen stays
    assert b.run_need("g", feeds) == 16_000 + OUTPUT_COPIES * 160
