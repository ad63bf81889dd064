"""Triton's system shared memory extension: POSIX shared memory regions (files in /dev/shm) that a client on the
same host registers by name and then names in inference requests instead of sending tensor bytes. An input is
copied out of its region into a fresh buffer; an output is written into its region and answered without its data.

- ``register(name, key, offset, byte_size)`` opens ``key`` (``shm_open``'s name: "/x" or "x", a regular file
  directly in /dev/shm; no other path, no symbolic link) and keeps [offset, offset + byte_size) of it. A name
  already registered: ALREADY_EXISTS; a key that is not such a name, does not exist, is a link or not a regular
  file, or a range past the end of the memory: INVALID_ARGUMENT.
- ``unregister(name)`` (every region when the name is empty); ``status(name)`` (every region when it is empty;
  an unknown name: NOT_FOUND).
- ``read(region, offset, byte_size, tensor)`` and ``write(region, offset, data, byte_size, tensor)``: the part of
  a region an input or output names (offset within the region), checked to lie inside it.

The memory belongs to the client, which may shrink it at any time, so it is never mapped: a mapping touched past
the end of its file kills the process with SIGBUS. Each region keeps its file open from register to unregister;
inputs are read with ``preadv`` (a short read means the memory shrank: INVALID_ARGUMENT naming the region) and
outputs written with ``pwrite`` once ``fstat`` shows the memory still holds the bytes they go to, so a write
never grows the file past the registered range (a client that shrinks it between that check and the write gets
it grown back to the end of the write, within the range: nothing worse). Arrays decoded from an input own their
copy and outlive the region. The registry is used from the event loop and from worker threads (large bodies):
a lock guards the regions, and each read or write works on its own duplicate of the region's descriptor, so
unregistering a region meanwhile cannot close the file under it. At most ``MAX_REGIONS`` are registered at once.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from servex.loader.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted

SHM_DIR = Path("/dev/shm")
NO_CUDA_MEMORY = (
    "CUDA shared memory is not supported: servex reads inputs from host memory; register system shared memory "
    "(/dev/shm) instead"
)
ALIGNMENT = 64  # bytes: inputs read from shared memory start on a boundary TensorFlow can use without a copy
MAX_REGIONS = 256  # each keeps a file open: a client registering without end would exhaust the descriptors


@dataclass(frozen=True)
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int  # the shared memory file, open read-write from register to unregister

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def placed(self) -> str:
        return f"bytes [{self.offset}, {self.offset + self.byte_size}) of shared memory {self.key!r}"


class SharedMemoryRegistry:
    def __init__(self, directory: Path = SHM_DIR, max_read_bytes: int | None = None):
        self.directory = directory
        self.max_read_bytes = max_read_bytes  # the most one input may read (--max_message_bytes); None: no bound
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidArgument("the region has no name: name it, then use the name in inference requests")
        with self._lock:
            if name in self._regions:
                raise AlreadyExists(f"shared memory region {name!r} is already registered; unregister it first")
        path = self.directory / self._file_name(key)
        if offset < 0 or byte_size <= 0:
            raise InvalidArgument(f"region {name!r}: offset {offset} and byte_size {byte_size}: expected an "
                                  f"offset of 0 or more and a byte_size of 1 or more")  # fmt: skip
        try:  # O_NOFOLLOW: as glibc's shm_open, never follow a link out of the directory
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
        except FileNotFoundError:
            raise InvalidArgument(f"shared memory key {key!r} does not exist (no {path})") from None
        except OSError as e:
            if e.errno == errno.ELOOP:  # what O_NOFOLLOW answers for a link
                raise InvalidArgument(
                    f"shared memory key {key!r} is a symbolic link ({path}): servex does not follow links; name "
                    f"the shared memory object itself"
                ) from None
            raise InvalidArgument(f"cannot open shared memory key {key!r}: {e.strerror}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise InvalidArgument(f"shared memory key {key!r} is not a regular file ({path}): expected a POSIX "
                                      f"shared memory object")  # fmt: skip
            if offset + byte_size > info.st_size:
                raise InvalidArgument(
                    f"region {name!r}: offset {offset} + byte_size {byte_size} runs past the end of shared memory "
                    f"{key!r}, which holds {info.st_size} bytes"
                )
            with self._lock:
                if name in self._regions:
                    raise AlreadyExists(f"shared memory region {name!r} is already registered; unregister it first")
                if len(self._regions) >= MAX_REGIONS:
                    raise ResourceExhausted(
                        f"{len(self._regions)} shared memory regions are registered, the most servex keeps (each "
                        f"holds a file open); unregister some first"
                    )
                self._regions[name] = Region(name, key, offset, byte_size, fd)
        except BaseException:
            os.close(fd)
            raise

    def unregister(self, name: str = "") -> None:
        """Forget ``name`` (every region when empty); unregistering an unknown name does nothing, as in Triton."""
        with self._lock:
            if name:
                gone = [self._regions.pop(name)] if name in self._regions else []
            else:
                gone = list(self._regions.values())
                self._regions.clear()
            for region in gone:
                os.close(region.fd)

    def status(self, name: str = "") -> list[dict]:
        with self._lock:
            if not name:
                return [r.status() for r in self._regions.values()]
            return [self._region(name).status()]

    def cuda_status(self, name: str = "") -> list[dict]:
        """CUDA shared memory regions: never any (registering one is UNIMPLEMENTED), so the list is empty and a
        named region NOT_FOUND, in the words of a Triton without GPUs. Unregistering CUDA regions has nothing to do,
        and succeeds, as there: Triton's own clients unregister them all before they start."""
        if not name:
            return []
        with self._lock:
            system = name in self._regions
        if system:
            raise NotFound(f"The region named {name!r} is registered as system shared memory, not CUDA shared memory")
        raise NotFound(f"Unable to find cuda shared memory region: {name!r}. {NO_CUDA_MEMORY}")

    def read(self, region: str, offset: int, byte_size: int, tensor: str, used: int = 0) -> memoryview:
        """A copy of the bytes of input ``tensor``: ``byte_size`` bytes at ``offset`` in ``region``, in a fresh
        buffer aligned to ``ALIGNMENT``. INVALID_ARGUMENT when the memory no longer holds them. ``used``: the
        bytes the request's other inputs already read take; together they are bounded as one request's decoded
        inputs are (RESOURCE_EXHAUSTED beyond)."""
        what = f"input {tensor!r}"
        if self.max_read_bytes is not None and used + byte_size > self.max_read_bytes:
            others = f"; with the request's other inputs ({used} bytes) that is" if used else " is"
            raise ResourceExhausted(
                f"{what}: shared_memory_byte_size {byte_size}{others} more than the limit of {self.max_read_bytes} "
                f"bytes for a request's inputs (--max_message_bytes)"
            )
        with self._use(region, offset, byte_size, what) as (r, fd):
            try:
                raw = np.empty(byte_size + ALIGNMENT, np.uint8)
            except MemoryError:
                raise ResourceExhausted(f"{what}: cannot allocate {byte_size} bytes to read it from shared memory "
                                        f"region {region!r}") from None  # fmt: skip
            skip = -raw.ctypes.data % ALIGNMENT
            view = memoryview(raw[skip : skip + byte_size])
            start = r.offset + offset
            done = 0
            while done < byte_size:  # one preadv reads at most about 2 GiB
                try:
                    count = os.preadv(fd, [view[done:]], start + done)
                except OSError as e:
                    raise InvalidArgument(f"{what}: cannot read shared memory region {region!r} ({r.placed()}): "
                                          f"{e.strerror}") from None  # fmt: skip
                if count == 0:
                    raise self._shrunk(r, fd, what)
                done += count
        return view

    def write(self, region: str, offset: int, data: bytes, byte_size: int, tensor: str) -> None:
        """Write output ``tensor``'s ``data`` at ``offset`` in ``region``, within the ``byte_size`` it was given.
        INVALID_ARGUMENT, with nothing written, when the memory no longer holds those bytes."""
        what = f"output {tensor!r}"
        with self._use(region, offset, byte_size, what) as (r, fd):
            view = memoryview(data).cast("B")
            if len(view) > byte_size:
                raise InvalidArgument(
                    f"{what} takes {len(view)} bytes, more than the {byte_size} of shared memory given to it "
                    f"(parameter shared_memory_byte_size)"
                )
            start = r.offset + offset
            if os.fstat(fd).st_size < start + len(view):  # pwrite past the end would grow the file
                raise self._shrunk(r, fd, what)
            done = 0
            while done < len(view):
                try:
                    done += os.pwrite(fd, view[done:], start + done)
                except OSError as e:
                    raise InvalidArgument(f"{what}: cannot write shared memory region {region!r} ({r.placed()}): "
                                          f"{e.strerror}") from None  # fmt: skip

    @contextmanager
    def _use(self, region: str, offset: int, byte_size: int, what: str) -> Iterator[tuple[Region, int]]:
        """``region`` and a duplicate of its descriptor, once [offset, offset + byte_size) is checked to lie in it."""
        with self._lock:
            r = self._region(region, what)
            if offset < 0:
                raise InvalidArgument(f"{what}: shared_memory_offset {offset} is negative: expected an offset of 0 "
                                      f"or more into region {region!r}")  # fmt: skip
            if byte_size < 0:
                raise InvalidArgument(f"{what}: shared_memory_byte_size {byte_size} is negative: expected a size of "
                                      f"0 or more")  # fmt: skip
            if offset + byte_size > r.byte_size:
                raise InvalidArgument(
                    f"{what}: shared_memory_offset {offset} + shared_memory_byte_size {byte_size} runs past region "
                    f"{region!r}, which holds {r.byte_size} bytes"
                )
            fd = os.dup(r.fd)
        try:
            yield r, fd
        finally:
            os.close(fd)

    @staticmethod
    def _shrunk(r: Region, fd: int, what: str) -> InvalidArgument:
        size = os.fstat(fd).st_size
        return InvalidArgument(
            f"{what}: shared memory region {r.name!r} is registered as {r.placed()}, but that memory now holds "
            f"only {size} bytes: it shrank after it was registered; unregister the region and register it again"
        )

    def _file_name(self, key: str) -> str:
        """The file name in the directory that ``key`` names; INVALID_ARGUMENT when it is not a plain name."""
        bare = key[1:] if key.startswith("/") else key
        if bare and "/" not in bare and "\0" not in bare and bare not in (".", ".."):
            try:
                bare.encode("utf-8")
                return bare
            except UnicodeEncodeError:  # a lone surrogate
                pass
        raise InvalidArgument(
            f"shared memory key {key!r} is not a POSIX shared memory name: expected '/name', a file directly in "
            f"{self.directory} (no '/', NUL or invalid Unicode in the name)"
        )

    def _region(self, name: str, what: str = "") -> Region:
        region = self._regions.get(name)
        if region is None:
            known = ", ".join(sorted(self._regions)) or "none"
            raise NotFound(
                f"{what + ': ' if what else ''}shared memory region {name!r} is not registered (registered: {known})"
            )
        return region
