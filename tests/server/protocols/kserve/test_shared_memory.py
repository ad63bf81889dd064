"""server/protocols/kserve/shared_memory.py: regions over real files (a folder standing in for /dev/shm), checked
ranges, and
arrays read from a region that outlive its registration; memory that shrinks under a region, links and odd keys
refused, and files closed when regions go."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from servex.loader.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from servex.server.protocols.kserve import shared_memory
from servex.server.protocols.kserve.shared_memory import SharedMemoryRegistry


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
        ("r", "/a\x00b", 0, 8, InvalidArgument, "key '/a\\x00b' is not a POSIX shared memory name"),
        ("r", "/\ud800", 0, 8, InvalidArgument, "key '/\\ud800' is not a POSIX shared memory name"),
        ("r", "/mem", 60, 8, InvalidArgument, "offset 60 + byte_size 8 runs past the end of shared memory"),
        ("r", "/mem", 0, 0, InvalidArgument, "a byte_size of 1 or more"),
    ],
)  # fmt: skip
def test_bad_registrations_are_refused_naming_what_was_wrong(registry, name, key, offset, size, error, words):
    with pytest.raises(error, match=re.escape(words)):
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


def test_memory_that_shrinks_after_registration_is_refused_and_never_touched(registry, tmp_path):
    registry.register("r", "/mem", 16, 32)
    array = np.frombuffer(registry.read("r", 0, 32, "x"), np.float32)  # read before the memory shrinks
    os.truncate(tmp_path / "mem", 20)  # the client shrinks its object: 4 bytes of the region are left
    assert array.tolist() == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]  # a copy: still readable (no SIGBUS)
    shrunk = r"region 'r' is registered as bytes \[16, 48\) of shared memory '/mem', but that memory now holds only 20"
    with pytest.raises(InvalidArgument, match="input 'x': shared memory " + shrunk):
        registry.read("r", 0, 8, "x")
    with pytest.raises(InvalidArgument, match="output 'y': shared memory " + shrunk):
        registry.write("r", 4, b"\1" * 8, 8, "y")
    assert (tmp_path / "mem").stat().st_size == 20  # the refused write did not grow the file
    assert np.frombuffer(registry.read("r", 0, 4, "x"), np.float32).tolist() == [4.0]  # what is left still works
    registry.write("r", 0, np.array([-1.0], np.float32).tobytes(), 4, "y")
    assert np.frombuffer((tmp_path / "mem").read_bytes(), np.float32)[4] == -1.0
    os.truncate(tmp_path / "mem", 0)
    with pytest.raises(InvalidArgument, match="now holds only 0 bytes"):
        registry.read("r", 0, 4, "x")


def test_links_and_files_that_are_not_regular_are_refused(registry, tmp_path):
    outside = tmp_path.parent / f"{tmp_path.name}-victim"
    outside.write_bytes(b"\1" * 64)  # a file the servex user can write, outside the shared memory directory
    (tmp_path / "link").symlink_to(outside)
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    (tmp_path / "inside").symlink_to(tmp_path / "mem")  # even a link to a shared memory object
    os.mkfifo(tmp_path / "fifo")
    for key in ("/link", "/dangling", "inside"):
        with pytest.raises(InvalidArgument, match=f"shared memory key '{key}' is a symbolic link"):
            registry.register("r", key, 0, 8)
    with pytest.raises(InvalidArgument, match="shared memory key '/fifo' is not a regular file"):
        registry.register("r", "/fifo", 0, 8)
    assert registry.status() == []
    assert outside.read_bytes() == b"\1" * 64


def test_negative_offsets_and_sizes_in_a_request_are_named_as_such(registry):
    registry.register("r", "/mem", 0, 16)
    with pytest.raises(InvalidArgument, match="input 'x': shared_memory_offset -4 is negative"):
        registry.read("r", -4, 8, "x")
    with pytest.raises(InvalidArgument, match="output 'y': shared_memory_offset -4 is negative"):
        registry.write("r", -4, b"\0" * 4, 4, "y")
    with pytest.raises(InvalidArgument, match="input 'x': shared_memory_byte_size -8 is negative"):
        registry.read("r", 0, -8, "x")


def open_files() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_region_keeps_its_file_open_until_it_is_unregistered(registry, tmp_path):
    before = open_files()
    registry.register("r", "/mem", 0, 64)
    registry.register("s", "/mem", 0, 8)
    assert len(open_files() - before) == 2
    (tmp_path / "mem").unlink()  # the object's name goes (shm_unlink); the registered memory stays
    assert np.frombuffer(registry.read("r", 60, 4, "x"), np.float32).tolist() == [15.0]
    registry.unregister("r")
    assert len(open_files() - before) == 1
    registry.unregister()
    (tmp_path / "mem").write_bytes(b"\0" * 8)
    os.mkfifo(tmp_path / "fifo")
    for key, size in (("/mem", 16), ("/fifo", 1)):  # refused after the file was opened
        with pytest.raises(InvalidArgument):
            registry.register("r", key, 0, size)
    assert open_files() == before


def test_registrations_are_bounded_since_each_keeps_a_file_open(registry, monkeypatch):
    monkeypatch.setattr(shared_memory, "MAX_REGIONS", 3)
    for name in ("a", "b", "c"):
        registry.register(name, "/mem", 0, 4)
    with pytest.raises(ResourceExhausted, match="3 shared memory regions are registered, the most servex keeps"):
        registry.register("d", "/mem", 0, 4)
    registry.unregister("a")
    registry.register("d", "/mem", 0, 4)  # room again
    assert [r["name"] for r in registry.status()] == ["b", "c", "d"]


def test_an_input_read_is_bounded_like_any_decoded_input(tmp_path):
    (tmp_path / "mem").write_bytes(bytes(64))
    registry = SharedMemoryRegistry(tmp_path, max_read_bytes=32)
    registry.register("r", "/mem", 0, 64)  # a region may be larger than one input
    assert len(registry.read("r", 0, 32, "x")) == 32
    with pytest.raises(ResourceExhausted, match="input 'x': shared_memory_byte_size 48 is more than the limit of 32"):
        registry.read("r", 0, 48, "x")
    # a request's inputs together: what its other inputs read counts
    assert len(registry.read("r", 0, 16, "y", used=16)) == 16
    with pytest.raises(ResourceExhausted, match=r"input 'y': shared_memory_byte_size 16; with the request's other "
                       r"inputs \(24 bytes\) that is more than the limit of 32 bytes"):  # fmt: skip
        registry.read("r", 0, 16, "y", used=24)
