"""A model version's variables: lazy restoration and the two registries.

- **Restore registry**: variable name -> (dtype, shape, future of the host tensor read from the checkpoint).
  Registering a name that exists succeeds only for an equal dtype and shape (idempotent), else ALREADY_EXISTS
  naming both specs. A variable's data is read at most once, on the restore pool (separate from the run workers).
- **Loaded-variable registry**: (name, device) -> the value placed on that device through the transfer executor
  factory, and assigned into the version's session; each variable is placed once per device and shared by every
  client graph of the version.

States, as ListVariables reports them: UNRESTORED (only the index is known), RESTORING, RESTORED (read into host
memory), ON_DEVICE (in the session's variable, ready for runs).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from loader.errors import InvalidArgument, NotFound, ServingError

log = logging.getLogger(__name__)

UNRESTORED, RESTORING, RESTORED, ON_DEVICE = "UNRESTORED", "RESTORING", "RESTORED", "ON_DEVICE"

# Reads from checkpoints and placements happen here, never on the run workers; a task here never waits on
# another task here.
RESTORE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="servex-restore")
# Client-graph builds that then wait for their variables (they wait on RESTORE_POOL tasks).
PREPARE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="servex-prepare")


class AlreadyExists(ServingError):
    code = "ALREADY_EXISTS"


def _spec(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


@dataclass
class RestoreEntry:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]
    future: Future | None = None
    seconds: float = 0.0


class RestoreRegistry:
    """Variable name -> (dtype, shape, future of its host tensor)."""

    def __init__(self, on_restored: Callable[[RestoreEntry, float], None] = lambda e, s: None):
        self._lock = threading.Lock()
        self._entries: dict[str, RestoreEntry] = {}
        self._on_restored = on_restored

    def register(
        self, name: str, dtype: np.dtype, shape: tuple[int, ...], read: Callable[[], np.ndarray]
    ) -> RestoreEntry:
        dtype, shape = np.dtype(dtype), tuple(shape)
        with self._lock:
            existing = self._entries.get(name)
            if existing is not None:
                if existing.dtype != dtype or existing.shape != shape:
                    raise AlreadyExists(
                        f"variable {name!r} is registered as {_spec(existing.dtype, existing.shape)}; "
                        f"registering it as {_spec(dtype, shape)} is refused"
                    )
                return existing
            entry = self._entries[name] = RestoreEntry(name, dtype, shape, read)
            return entry

    def get(self, name: str) -> RestoreEntry:
        entry = self._entries.get(name)
        if entry is None:
            raise NotFound(f"no variable {name!r} is registered")
        return entry

    def restore(self, name: str) -> Future:
        """The future of ``name``'s host tensor. The first caller reads it, in its own thread (callers are on the
        restore pool); later callers share that one read."""
        entry = self.get(name)
        with self._lock:
            future, reader = entry.future, entry.future is None
            if reader:
                future = entry.future = Future()
                future.set_running_or_notify_cancel()
        if reader:
            try:
                future.set_result(self._read(entry))
            except BaseException as e:
                with self._lock:
                    entry.future = None  # a later caller may try again
                future.set_exception(e)
        return future

    def _read(self, entry: RestoreEntry) -> np.ndarray:
        start = time.perf_counter()
        value = entry.read()
        if value.dtype != entry.dtype or tuple(value.shape) != entry.shape:
            raise InvalidArgument(
                f"variable {entry.name!r}: the checkpoint holds {_spec(value.dtype, value.shape)}, the index said "
                f"{_spec(entry.dtype, entry.shape)}"
            )
        entry.seconds = time.perf_counter() - start
        self._on_restored(entry, entry.seconds)
        return value

    def state(self, name: str) -> str:
        future = self.get(name).future
        if future is None:
            return UNRESTORED
        return RESTORED if future.done() and future.exception() is None else RESTORING

    def forget(self, name: str) -> None:
        """Drop the host copy once the value lives on its device (the future keeps no tensor after this)."""
        entry = self.get(name)
        with self._lock:
            if entry.future is not None and entry.future.done() and entry.future.exception() is None:
                done: Future = Future()
                done.set_result(None)
                entry.future = done

    def names(self) -> list[str]:
        return sorted(self._entries)


class LoadedVariableRegistry:
    """(name, device) -> the future of the variable's placement on that device, made once and shared."""

    def __init__(self):
        self._lock = threading.Lock()
        self._placed: dict[tuple[str, str], Future] = {}

    def get_or_place(self, name: str, device: str, place: Callable[[], None]) -> Future:
        """Run ``place()`` (once, on the restore pool) to put the value on the device; failures may retry."""
        with self._lock:
            future = self._placed.get((name, device))
            if future is None or (future.done() and future.exception() is not None):
                future = self._placed[(name, device)] = RESTORE_POOL.submit(place)
            return future

    def placed(self, name: str, device: str) -> bool:
        future = self._placed.get((name, device))
        return future is not None and future.done() and future.exception() is None

    def pending(self, name: str, device: str) -> bool:
        future = self._placed.get((name, device))
        return future is not None and not future.done()


def all_of(futures: list[Future]) -> Future:
    """A future that completes when every one of ``futures`` has (with the first failure, if any)."""
    combined: Future = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(f: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if f.exception() is not None and not combined.done():
            try:
                combined.set_exception(f.exception())
            except Exception:  # another failure won the race
                pass
        elif last and not combined.done():
            try:
                combined.set_result(None)
            except Exception:
                pass

    for f in futures:
        f.add_done_callback(done)
    return combined


@dataclass(frozen=True)
class VariableRecord:
    """A graph variable and how to restore it: its checkpoint key and the feed/assign pair built for it."""

    name: str  # the variable op
    key: str  # its checkpoint key
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    placeholder: str  # tensor fed with the value
    assign: str  # op that assigns it
    resource: bool  # a resource variable (VarHandleOp) rather than a TF1 ref variable


class RunGate:
    """Many runs at once, or one assignment: a run never reads a ref variable while it is being replaced."""

    def __init__(self):
        self._cond = threading.Condition()
        self._runs = 0
        self._writing = False

    def enter(self) -> None:
        with self._cond:
            while self._writing:
                self._cond.wait()
            self._runs += 1

    def leave(self) -> None:
        with self._cond:
            self._runs -= 1
            if self._runs == 0:
                self._cond.notify_all()

    def exclusive(self, fn: Callable[[], None]) -> None:
        with self._cond:
            while self._writing:
                self._cond.wait()
            self._writing = True
            while self._runs:
                self._cond.wait()
        try:
            fn()
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class VariableStore:
    """One model version's variables: restored lazily through the registries, listed, prefetched, replaced."""

    def __init__(
        self,
        records: dict[str, VariableRecord],
        read: Callable[[str], np.ndarray],
        session,
        device: str = "cpu",
        transfer=None,
        hooks: VariableHooks | None = None,
    ):
        self.records = records
        self._session = session
        self.device = device
        self._transfer = transfer
        self.hooks = hooks or VariableHooks()
        self.restore_registry = RestoreRegistry(lambda entry, seconds: self.hooks.restored(entry, seconds))
        for record in records.values():
            self.restore_registry.register(record.name, record.dtype, record.shape, lambda k=record.key: read(k))
        self.loaded = LoadedVariableRegistry()
        # Resource variables are replaced atomically by TensorFlow itself; ref variables need the gate.
        self.gate = RunGate() if any(not r.resource for r in records.values()) else None
        self.hooks.changed(self)

    def ensure(self, names: Iterable[str]) -> Future | None:
        """A future that completes when these variables are on the device; None when they already are."""
        pending = [
            self.loaded.get_or_place(n, self.device, lambda n=n: self._place(n))
            for n in names
            if n in self.records and not self.loaded.placed(n, self.device)
        ]
        if not pending:
            return None
        combined = all_of(pending)
        combined.add_done_callback(lambda _: self.hooks.changed(self))  # states as they now are
        return combined

    def _place(self, name: str) -> None:
        record = self.records[name]
        value = self.restore_registry.restore(name).result()
        self._assign(record, value)
        self.restore_registry.forget(name)  # the session's variable holds it now; drop the host copy
        log.info("variable %r restored (%d bytes)", name, record.nbytes)

    def _assign(self, record: VariableRecord, value: np.ndarray) -> None:
        if self._transfer is not None:
            value = self._transfer.transfer([value])[0]
        self._session.run(record.assign, {record.placeholder: value})

    def state(self, name: str) -> str:
        if self.loaded.placed(name, self.device):
            return ON_DEVICE
        state = self.restore_registry.state(name)
        return RESTORING if state == UNRESTORED and self.loaded.pending(name, self.device) else state

    def listing(self) -> list[tuple[VariableRecord, str]]:
        return [(self.records[n], self.state(n)) for n in sorted(self.records)]

    def assign(self, name: str, value: np.ndarray) -> None:
        """Replace a variable's value atomically: same dtype and shape only; runs see the old or the new value."""
        record = self.records.get(name)
        if record is None:
            raise NotFound(f"no variable {name!r}; variables: {', '.join(sorted(self.records)) or 'none'}")
        if value.dtype != record.dtype or tuple(value.shape) != record.shape:
            raise InvalidArgument(
                f"variable {name!r} is {_spec(record.dtype, record.shape)}; the new value is "
                f"{_spec(value.dtype, value.shape)}: only an equal dtype and shape can replace it"
            )
        ready = self.ensure([name])  # restore first, so that a later restore cannot overwrite the new value
        if ready is not None:
            ready.result()
        if self.gate is not None:
            self.gate.exclusive(lambda: self._assign(record, value))
        else:
            self._assign(record, value)
        log.info("variable %r replaced (%s)", name, _spec(record.dtype, record.shape))
        self.hooks.assigned(self)


class VariableHooks:
    """What the variable store reports (metrics); the default reports nothing."""

    def restored(self, entry: RestoreEntry, seconds: float) -> None: ...

    def changed(self, store: VariableStore) -> None: ...

    def assigned(self, store: VariableStore) -> None: ...

    def remove(self) -> None:
        """The version unloaded: forget what was reported for it."""
