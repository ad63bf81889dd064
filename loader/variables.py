"""A model version's variables: lazy restoration and the two registries.

- **Restore registry**: variable name -> (dtype, shape, future of its one read). Registering a name that exists
  succeeds only for an equal dtype and shape (idempotent), else ALREADY_EXISTS naming both specs. A variable's data
  is read at most once, on the restore pool (separate from the run workers), by TensorFlow itself: the version's
  graph holds RestoreV2 ops of the checkpoint entries feeding an assign per variable (built at load: with lazy
  restoration one per variable, and one per set of variables a restore will likely bring in together; eager, one
  for all), so the data goes from the file into a buffer the variable owns, with no host copy in Python.
- **Loaded-variable registry**: (name, device) -> the future of the variable's placement on that device (its
  read, above); each variable is placed once per device and shared by every client graph of the version. New
  values (AssignVariable) go through the transfer executor factory.

States, as ListVariables reports them: UNRESTORED (only the index is known), RESTORING, RESTORED (read; the read
puts it in the session's variable, so this lasts an instant), ON_DEVICE (in the session's variable, ready for runs).
"""

from __future__ import annotations

import glob
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import tensorflow as tf

from servex.loader.errors import InvalidArgument, NotFound, ServingError, error_with_code

log = logging.getLogger(__name__)

UNRESTORED, RESTORING, RESTORED, ON_DEVICE = "UNRESTORED", "RESTORING", "RESTORED", "ON_DEVICE"

# Reads from checkpoints and placements happen here, never on the run workers; a task here never waits on
# another task here.
RESTORE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="servex-restore")
# Client-graph builds that then wait for their variables (they wait on RESTORE_POOL tasks).
PREPARE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="servex-prepare")


class AlreadyExists(ServingError):
    code = "ALREADY_EXISTS"


def _op_error_text(e: tf.errors.OpError) -> str:
    """TensorFlow's words for a failed op, without what the session adds to an op built in Python (where it was
    built, and the node's name)."""
    text = e.message
    if "\nNode: " in text:  # "Graph execution error: Detected at node ... defined at (stack) Node: 'name'"
        text = text.split("\nNode: ", 1)[1].partition("\n")[2]
    return text.split("\n\t [[", 1)[0].strip()


def _spec(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


@dataclass
class RestoreEntry:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    future: Future | None = None  # of the read that brings this variable's data in


class RestoreRegistry:
    """Variable name -> (dtype, shape, future of its one read). ``read(names)`` reads several variables at once:
    one call per restore, however many variables it brings (one TensorFlow run, not one per variable)."""

    def __init__(
        self,
        read: Callable[[list[str]], None],
        on_restored: Callable[[list[RestoreEntry], float], None] = lambda entries, seconds: None,
    ):
        self._lock = threading.Lock()
        self._entries: dict[str, RestoreEntry] = {}
        self._read = read
        self._on_restored = on_restored

    def register(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> RestoreEntry:
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
            entry = self._entries[name] = RestoreEntry(name, dtype, shape)
            return entry

    def get(self, name: str) -> RestoreEntry:
        entry = self._entries.get(name)
        if entry is None:
            raise NotFound(f"no variable {name!r} is registered")
        return entry

    def restore(self, names: Iterable[str]) -> Future:
        """A future that completes when every one of ``names`` is read. The caller reads, in its own thread (callers
        are on the restore pool) and in one ``read``, those no one has read or is reading; it shares the reads of
        the others. After a failed read, the next caller tries those variables again."""
        entries = [self.get(name) for name in dict.fromkeys(names)]
        with self._lock:
            mine = [entry for entry in entries if not _live(entry.future)]
            for entry in mine:
                entry.future = Future()
            waits = [entry.future for entry in entries]
        if mine:
            _settle([entry.future for entry in mine], partial(self._timed_read, mine))
        return all_of(waits)

    def _timed_read(self, entries: list[RestoreEntry]) -> None:
        start = time.perf_counter()
        self._read([entry.name for entry in entries])
        self._on_restored(entries, time.perf_counter() - start)

    def state(self, name: str) -> str:
        future = self.get(name).future
        if not _live(future):  # never read, or its read failed (the next caller reads again)
            return UNRESTORED
        return RESTORED if future.done() and future.exception() is None else RESTORING

    def names(self) -> list[str]:
        return sorted(self._entries)


class LoadedVariableRegistry:
    """(name, device) -> the future of the variable's placement on that device, made once and shared."""

    def __init__(self):
        self._lock = threading.Lock()
        self._placed: dict[tuple[str, str], Future] = {}

    def place(self, names: Iterable[str], device: str, place: Callable[[list[str]], None]) -> list[Future]:
        """The futures of ``names``' placements on ``device``. Those not placed nor being placed (or whose placement
        failed) are placed by one ``place(their names)`` on the restore pool."""
        with self._lock:
            futures, batch, batch_names = [], [], []
            for name in names:
                future = self._placed.get((name, device))
                if not _live(future):
                    future = self._placed[(name, device)] = Future()
                    batch.append(future)
                    batch_names.append(name)
                futures.append(future)
        if batch:
            RESTORE_POOL.submit(_settle, batch, partial(place, batch_names))
        return futures

    def placed(self, name: str, device: str) -> bool:
        future = self._placed.get((name, device))
        return future is not None and future.done() and future.exception() is None

    def pending(self, name: str, device: str) -> bool:
        future = self._placed.get((name, device))
        return future is not None and not future.done()


def _live(future: Future | None) -> bool:
    """A future that stands: pending or succeeded (a failed one is replaced by the next caller's)."""
    return future is not None and not (future.done() and future.exception() is not None)


def _settle(futures: list[Future], fn: Callable[[], None]) -> None:
    """Run ``fn()`` and complete ``futures`` with its outcome."""
    for future in futures:
        future.set_running_or_notify_cancel()
    try:
        fn()
    except BaseException as e:
        for future in futures:
            future.set_exception(e)
    else:
        for future in futures:
            future.set_result(None)


def all_of(futures: list[Future]) -> Future:
    """A future that completes when every one of ``futures`` has (with the first failure, if any)."""
    combined: Future = Future()
    if not futures:
        combined.set_result(None)
        return combined
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
    """A graph variable: its checkpoint key, and the assign that gives it its checkpoint entry's value (or, with
    ``value`` fed, a new value)."""

    name: str  # the variable op
    key: str  # its checkpoint key
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    value: str  # the read's output that ``assign`` assigns; fed with a new value, the read does not run
    assign: str  # op that assigns ``value`` to the variable
    resource: bool  # a resource variable (VarHandleOp) rather than a TF1 ref variable


@dataclass(frozen=True)
class RestoreOp:
    """One read of the checkpoint (a RestoreV2 of some entries) and the assigns it feeds: running ``assigns``
    restores exactly ``variables``."""

    variables: frozenset[str]
    assigns: tuple[str, ...]


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
        session,
        device: str = "cpu",
        transfer=None,
        hooks: VariableHooks | None = None,
        restores: Iterable[RestoreOp] | None = None,
        checkpoint: str = "",
    ):
        """``restores``: the reads a restore can run (default: each record's assign, reading that variable);
        a restore runs those of the largest sets it needs whole, then those of one variable. ``checkpoint``: the
        checkpoint's prefix (its files are named in a failed read's error)."""
        self.records = records
        self.checkpoint = checkpoint
        if restores is None:
            restores = [RestoreOp(frozenset([r.name]), (r.assign,)) for r in records.values()]
        self._single = {}  # variable -> the assign of its own read
        self._groups = []  # reads of several variables, largest first
        for op in restores:
            if len(op.variables) == 1:
                self._single.update(zip(op.variables, op.assigns, strict=True))
            else:
                self._groups.append(op)
        self._groups.sort(key=lambda op: -len(op.variables))
        # Every session over the version's graph holds the variables: restores and new values go to each of them
        # (a second session: one with one intra-op thread, loader/one_thread.py). Many restores or assignments at
        # once, or one session added.
        self._sessions = [session]
        self._sessions_gate = RunGate()
        self._restored: set[str] = set()  # read into every session
        self.assigned: set[str] = set()  # given new values through assign()
        self.device = device
        self._transfer = transfer
        self.hooks = hooks or VariableHooks()
        self.restore_registry = RestoreRegistry(self._restore, self.hooks.restored)
        for record in records.values():
            self.restore_registry.register(record.name, record.dtype, record.shape)
        self.loaded = LoadedVariableRegistry()
        # Resource variables are replaced atomically by TensorFlow itself; ref variables need the gate.
        self.gate = RunGate() if any(not r.resource for r in records.values()) else None
        self.hooks.changed(self)

    def ensure(self, names: Iterable[str]) -> Future | None:
        """A future that completes when these variables are on the device; None when they already are."""
        pending = [n for n in names if n in self.records and not self.loaded.placed(n, self.device)]
        if not pending:
            return None
        combined = all_of(self.loaded.place(pending, self.device, self._place))
        combined.add_done_callback(lambda _: self.hooks.changed(self))  # states as they now are
        return combined

    def _place(self, names: list[str]) -> None:
        self.restore_registry.restore(names).result()
        log.info("%d variables restored (%d bytes)", len(names), sum(self.records[n].nbytes for n in names))

    def _restore(self, names: list[str]) -> None:
        """Read the variables' checkpoint entries straight into them, inside TensorFlow, in one run (a RestoreV2 per
        group of them or per variable, feeding an assign per variable that adopts the read buffer): one buffer
        each, the variable's own.

        - Fed from Python instead (a host array read, then assigned), a variable shared a buffer it did not own,
          and TensorFlow copies such a buffer on the first sparse read (an embedding lookup) while the old one
          stays held: the process kept twice the table, until 2026-11-24.
        - One run per variable instead made TensorFlow build an executor for each (pruning the whole graph each
          time): 300 variables took 18 s to restore, 2,000 over 20 minutes."""
        self._sessions_gate.enter()
        try:
            targets = self._restore_targets(names)
            for session in self._sessions:
                session.run(targets)
            self._restored.update(names)
        except tf.errors.OpError as e:  # the checkpoint's files changed or broke after the load
            first = sorted(names)[:5]
            shown = ", ".join(map(repr, first)) + (f" and {len(names) - len(first)} more" if len(names) > 5 else "")
            raise error_with_code(
                13, f"reading variable(s) {shown} from the checkpoint failed: {_op_error_text(e)}{self._files()}"
            ) from e
        finally:
            self._sessions_gate.leave()

    def add_session(self, session, first: Iterable[str], init: Callable[[object], None]) -> bool:
        """Give ``session`` (a new one over the same graph) the variables the others hold: the restored ones of
        ``first`` (those the init op reads), then ``init(session)`` (the init op), then the other restored ones,
        as the load did; restores and new values then go to it too. False, with nothing done, once a variable was
        given a new value (a copy of it would come from the checkpoint)."""
        added = []

        def add() -> None:
            if self.assigned:
                return
            before = [n for n in first if n in self._restored]
            if before:
                session.run(self._restore_targets(before))
            init(session)
            after = sorted(self._restored.difference(before))
            if after:
                session.run(self._restore_targets(after))
            self._sessions.append(session)
            added.append(session)

        self._sessions_gate.exclusive(add)
        return bool(added)

    def remove_session(self, session) -> None:
        """Restores and new values no longer go to ``session`` (add_session's)."""
        self._sessions_gate.exclusive(lambda: self._sessions.remove(session))

    def _files(self) -> str:
        """The checkpoint's files, for an error (a failed read's message may not name them: "Read less bytes than
        requested"); they may be gone: the pattern is named then."""
        if not self.checkpoint:
            return ""
        files = sorted(glob.glob(glob.escape(self.checkpoint) + ".data-*"))
        return f" (checkpoint files: {', '.join(files) or self.checkpoint + '.data-*: none found'})"

    def _restore_targets(self, names: list[str]) -> list[str]:
        """The assigns that restore exactly ``names``: whole groups (one RestoreV2 each), then single reads."""
        remaining = set(names)
        targets = []
        for op in self._groups:
            if len(op.variables) <= len(remaining) and op.variables <= remaining:
                targets.extend(op.assigns)
                remaining -= op.variables
        missing = sorted(n for n in remaining if n not in self._single)
        if missing:  # only a group reads them (all restored at load): reading it would overwrite the others
            raise error_with_code(
                13, f"variable(s) {', '.join(map(repr, missing[:5]))} can only be read with others, all at once"
            )
        targets.extend(self._single[n] for n in remaining)
        return targets

    def _assign(self, record: VariableRecord, value: np.ndarray) -> None:
        if self._transfer is not None:
            value = self._transfer.transfer([value])[0]
        self._sessions_gate.enter()
        try:
            for session in self._sessions:
                session.run(record.assign, {record.value: value})
            self.assigned.add(record.name)
        finally:
            self._sessions_gate.leave()

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

    def restored(self, entries: list[RestoreEntry], seconds: float) -> None: ...

    def changed(self, store: VariableStore) -> None: ...

    def assigned(self, store: VariableStore) -> None: ...

    def remove(self) -> None:
        """The version unloaded: forget what was reported for it."""
