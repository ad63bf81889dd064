"""server/shared_memory.py: regions over real files (a folder standing in for /dev/shm), checked ranges, and
arrays read from a region that outlive its registration."""

from __future__ import annotations

import numpy as np
import pytest

from loader.errors import AlreadyExists, InvalidArgument, NotFound
from server.shared_memory import SharedMemoryRegistry


@pytest.fixture
def registry(tmp_path):
    (tmp_path / "mem").write_bytes(np.arange(16, dtype=np.float32).tobytes())  # 64 bytes
    return SharedMemoryRegistry(tmp_path)


def test_a_region_is_a_range_of_the_memory_read_and_written_in_place(registry, tmp_path):
    registry.register("r", "/mem", 16, 32)  # floats 4..11
    assert registry.status() == [{"name": "r", "key": "/mem", "offset": 16, "byte_size": 32}]
    assert registry.status("r") == registry.status()
    view = registry.read("r", 8, 8, "x")  # floats 6 and 7
    assert np.frombuffer(view, np.float32).tolist() == [6.0, 7.0]
    registry.write("r", 0, np.array([-1.0], np.float32).tobytes(), 4, "y")
    assert np.frombuffer((tmp_path / "mem").read_bytes(), np.float32)[4] == -1.0  # in the memory itself


def test_an_array_read_from_a_region_outlives_its_registration(registry):
    registry.register("r", "mem", 0, 64)
    array = np.frombuffer(registry.read("r", 0, 64, "x"), np.float32)
    registry.unregister("r")
    assert array.sum() == sum(range(16))
    with pytest.raises(NotFound, match="region 'r' is not registered"):
        registry.read("r", 0, 4, "x")


@pytest.mark.parametrize(
    ("name", "key", "offset", "size", "error", "words"),
    [
        ("", "/mem", 0, 8, InvalidArgument, "the region has no name"),
        ("r", "/nope", 0, 8, InvalidArgument, "shared memory key '/nope' does not exist"),
        ("r", "/../mem", 0, 8, InvalidArgument, "is not a POSIX shared memory name"),
        ("r", "/a/b", 0, 8, InvalidArgument, "is not a POSIX shared memory name"),
        ("r", "/", 0, 8, InvalidArgument, "is not a POSIX shared memory name"),
        ("r", "/mem", 60, 8, InvalidArgument, "offset 60 + byte_size 8 runs past the end of shared memory"),
        ("r", "/mem", 0, 0, InvalidArgument, "a byte_size of 1 or more"),
    ],
)  # fmt: skip
def test_bad_registrations_are_refused_naming_what_was_wrong(registry, name, key, offset, size, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace("+", r"\+")):
        registry.register(name, key, offset, size)
    assert registry.status() == []


def test_a_name_registers_once_and_ranges_stay_inside_their_region(registry):
    registry.register("r", "/mem", 0, 16)
    with pytest.raises(AlreadyExists, match="'r' is already registered"):
        registry.register("r", "/mem", 0, 8)
    with pytest.raises(InvalidArgument, match="input 'x': shared_memory_offset 8 \\+ shared_memory_byte_size 16"):
        registry.read("r", 8, 16, "x")
    with pytest.raises(InvalidArgument, match="output 'y' takes 8 bytes, more than the 4"):
        registry.write("r", 0, b"\0" * 8, 4, "y")
    with pytest.raises(NotFound, match="registered: r"):
        registry.status("other")
    registry.register("s", "/mem", 0, 4)
    registry.unregister()  # every region
    assert registry.status() == []
