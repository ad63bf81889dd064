"""Triton's system shared memory extension: POSIX shared memory regions (files in /dev/shm) that a client on the
same host registers by name and then names in inference requests instead of sending tensor bytes. An input is
read from its region without a copy; an output is written into its region and answered without its data.

- ``register(name, key, offset, byte_size)`` maps ``key`` (``shm_open``'s name: "/x" or "x", a file directly in
  /dev/shm; no other path is accepted) and keeps [offset, offset + byte_size) of it. A name already registered:
  ALREADY_EXISTS; a key that does not exist, or a range past the end of the memory: INVALID_ARGUMENT.
- ``unregister(name)`` (every region when the name is empty); ``status(name)`` (every region when it is empty;
  an unknown name: NOT_FOUND).
- ``read(region, offset, byte_size, tensor)`` and ``write(region, offset, data, byte_size, tensor)``: the part of
  a region an input or output names (offset within the region), checked to lie inside it.

Regions are kept by the serving core and used from the event loop only. A region's mapping closes once nothing
uses it: arrays decoded from it keep it open after it is unregistered.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from loader.errors import AlreadyExists, InvalidArgument, NotFound

SHM_DIR = Path("/dev/shm")
NO_CUDA_MEMORY = (
    "CUDA shared memory is not supported: servex reads inputs from host memory; register system shared memory "
    "(/dev/shm) instead"
)


@dataclass(frozen=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    memory: memoryview  # the registered range: byte_size bytes from offset

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


class SharedMemoryRegistry:
    def __init__(self, directory: Path = SHM_DIR):
        self.directory = directory
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidArgument("the region has no name: name it, then use the name in inference requests")
        if name in self._regions:
            raise AlreadyExists(f"shared memory region {name!r} is already registered; unregister it first")
        bare = key[1:] if key.startswith("/") else key
        if not bare or "/" in bare or bare in (".", ".."):
            raise InvalidArgument(
                f"shared memory key {key!r} is not a POSIX shared memory name: expected '/name', a file directly "
                f"in {self.directory}"
            )
        if offset < 0 or byte_size <= 0:
            raise InvalidArgument(f"region {name!r}: offset {offset} and byte_size {byte_size}: expected an "
                                  f"offset of 0 or more and a byte_size of 1 or more")  # fmt: skip
        try:
            fd = os.open(self.directory / bare, os.O_RDWR)
        except FileNotFoundError:
            raise InvalidArgument(f"shared memory key {key!r} does not exist (no {self.directory / bare})") from None
        except OSError as e:
            raise InvalidArgument(f"cannot open shared memory key {key!r}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InvalidArgument(
                    f"region {name!r}: offset {offset} + byte_size {byte_size} runs past the end of shared memory "
                    f"{key!r}, which holds {size} bytes"
                )
            whole = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._regions[name] = Region(name, key, offset, byte_size, memoryview(whole)[offset : offset + byte_size])

    def unregister(self, name: str = "") -> None:
        """Forget ``name`` (every region when empty); unregistering an unknown name does nothing, as in Triton."""
        if name:
            self._regions.pop(name, None)
        else:
            self._regions.clear()

    def status(self, name: str = "") -> list[dict]:
        if not name:
            return [r.status() for r in self._regions.values()]
        return [self._region(name).status()]

    def read(self, region: str, offset: int, byte_size: int, tensor: str) -> memoryview:
        """The bytes of input ``tensor``: ``byte_size`` bytes at ``offset`` in ``region``, without a copy."""
        return self._part(region, offset, byte_size, f"input {tensor!r}")

    def write(self, region: str, offset: int, data: bytes, byte_size: int, tensor: str) -> None:
        """Write output ``tensor``'s ``data`` at ``offset`` in ``region``, within the ``byte_size`` it was given."""
        if len(data) > byte_size:
            raise InvalidArgument(
                f"output {tensor!r} takes {len(data)} bytes, more than the {byte_size} of shared memory given to it "
                f"(parameter shared_memory_byte_size)"
            )
        self._part(region, offset, byte_size, f"output {tensor!r}")[: len(data)] = data

    def _part(self, region: str, offset: int, byte_size: int, what: str) -> memoryview:
        r = self._region(region, what)
        if offset < 0 or byte_size < 0 or offset + byte_size > r.byte_size:
            raise InvalidArgument(
                f"{what}: shared_memory_offset {offset} + shared_memory_byte_size {byte_size} runs past region "
                f"{region!r}, which holds {r.byte_size} bytes"
            )
        return r.memory[offset : offset + byte_size]

    def _region(self, name: str, what: str = "") -> Region:
        region = self._regions.get(name)
        if region is None:
            known = ", ".join(sorted(self._regions)) or "none"
            raise NotFound(
                f"{what + ': ' if what else ''}shared memory region {name!r} is not registered (registered: {known})"
            )
        return region
