"""ModelManager: which versions of which models are served, how they change, and lookup for requests.

Generic over the servable, as TensorFlow Serving's manager is: the caller supplies ``make_servable(name,
version, path)`` (the server wires a GraphExecutor over a loaded SavedModel) and ``close_servable``.

Lifecycle, as TensorFlow Serving's, without its faults:
- ``apply_config`` sets the models; ``poll`` re-reads every model's base path. Both are serialized by one lock
  and run off the request path (loads happen outside the table lock, so requests never wait on a load).
- Per model, the version policy picks the versions to serve among those on disk that are not known bad. A new
  version serves before an old one unloads (availability-preserving), and an old version unloads only once its
  in-flight requests have finished (each request holds a lease from ``acquire`` to ``release``).
- A version that was unloaded stays in the status as END (TensorFlow Serving's ServableStateMonitor keeps it so),
  until its number loads again or the model leaves the config; the last MAX_ENDED per model are kept.
- A version that fails to load is kept as END with its error (GetModelStatus shows it), never disturbs the served
  versions, and is retried up to ``max_num_load_retries`` times, ``load_retry_interval_s`` apart, and again
  whenever its folder's files change (a folder still being copied).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from servex.loader.config import ModelSpec
from servex.loader.errors import FailedPrecondition, InvalidArgument, LoadError, NotFound, ServingError, Unavailable
from servex.loader.versions import folder_fingerprint, list_versions

log = logging.getLogger(__name__)

S = TypeVar("S")

# TensorFlow Serving's ModelVersionStatus.State names.
LOADING, AVAILABLE, UNLOADING, END = "LOADING", "AVAILABLE", "UNLOADING", "END"
# Unloaded versions a model's status keeps showing (as END), the most recently unloaded first.
MAX_ENDED = 64


def _not_found(message: str, tfserving: str) -> NotFound:
    """NotFound saying ``message``, and ``tfserving`` where TensorFlow Serving's APIs answer it."""
    error = NotFound(message)
    error.tfserving = tfserving
    return error


def _unknown_label(name: str, label: str, spec: ModelSpec) -> InvalidArgument:
    """INVALID_ARGUMENT, in TensorFlow Serving's words first ("Unrecognized servable version label: L"): labels are
    TensorFlow Serving's (ModelSpec.version_label, REST's /labels/L)."""
    labels = ", ".join(f"{k}={v}" for k, v in sorted(spec.labels.items())) or "none"
    return InvalidArgument(
        f"Unrecognized servable version label: {label}; model {name!r} has no version label {label!r} "
        f"(labels: {labels})"
    )


@dataclass(eq=False)
class ServedVersion(Generic[S]):
    name: str
    version: int
    path: str
    servable: S | None = None
    state: str = LOADING
    error: ServingError | None = None
    # load attempts so far, when the next retry is due, and the folder's fingerprint when it was last loaded (or
    # failed to)
    attempts: int = 0
    retry_at: float = 0.0
    fingerprint: tuple = ()
    # requests in flight (leases) and whether the version has been taken out of service
    inflight: int = 0
    retired: bool = False
    # the model's Triton config.pbtxt the version loaded with (ModelSpec.triton_config): a changed one reloads it
    config: object | None = None


@dataclass
class _Model(Generic[S]):
    spec: ModelSpec
    versions: dict[int, ServedVersion[S]] = field(default_factory=dict)
    error: ServingError | None = None  # the base path itself is unusable
    # Failed reloads of a version number whose copy from an older base path still serves: their attempts,
    # retry time and fingerprint bound the retries as for any failed load.
    failed_reloads: dict[int, ServedVersion[S]] = field(default_factory=dict)
    # Versions taken out of service (UNLOADING until their last request ends, then END), for the status only.
    ended: dict[int, ServedVersion[S]] = field(default_factory=dict)

    def end(self, sv: ServedVersion[S]) -> None:
        self.ended.pop(sv.version, None)
        self.ended[sv.version] = sv
        while len(self.ended) > MAX_ENDED:
            del self.ended[next(iter(self.ended))]

    def available(self) -> list[int]:
        return sorted(v for v, sv in self.versions.items() if sv.state == AVAILABLE)

    def latest(self) -> ServedVersion[S] | None:
        """The highest available version (what a request naming no version gets), or None."""
        best, best_version = None, None
        for v, sv in self.versions.items():
            if sv.state == AVAILABLE and (best_version is None or v > best_version):
                best, best_version = sv, v
        return best


class ModelManager(Generic[S]):
    def __init__(
        self,
        make_servable: Callable[[str, int, str], S],
        close_servable: Callable[[S], None] = lambda s: None,
        *,
        max_num_load_retries: int = 5,
        load_retry_interval_s: float = 60.0,
        on_load: Callable[[str, int, bool, float, str], None] | None = None,
    ):
        self._make = make_servable
        # Told of every load attempt's outcome: (name, version, succeeded, seconds, the version's path); for metrics.
        self._on_load = on_load or (lambda name, version, ok, seconds, path: None)
        self._close = close_servable
        self.max_num_load_retries = max_num_load_retries
        self.load_retry_interval_s = load_retry_interval_s
        # Reload a served version whose files changed in place (same number, same path): Triton's poll mode does;
        # TensorFlow Serving's does not (a version folder is not rewritten there), so off by default.
        self.reload_changed_files = False
        self._lock = threading.Lock()  # guards the tables; held only briefly, never during a load
        self._reconcile_lock = threading.Lock()  # serializes config changes and polls
        self._models: dict[str, _Model[S]] = {}
        self._closed = False

    # -- changing what is served ----------------------------------------------------------------------

    def apply_config(self, specs: list[ModelSpec]) -> list[str]:
        """Serve exactly these models; returns the problems (failed loads, bad labels), empty when all is well.

        Removed models stop taking requests at once and unload when their in-flight requests finish. A config that
        moves a model's existing version label to a version that is not available is refused whole, nothing
        changed (FailedPrecondition), as TensorFlow Serving refuses it: its clients calling by that label would
        get NOT_FOUND. A new label may name a version that is not available yet (it serves once that version
        does).
        """
        with self._reconcile_lock:
            wanted = {spec.name: spec for spec in specs}
            with self._lock:
                self._check_label_moves(specs)
                removed = [m for name, m in self._models.items() if name not in wanted]
                for model in removed:
                    del self._models[model.spec.name]
                for spec in specs:
                    model = self._models.get(spec.name)
                    if model is None:
                        self._models[spec.name] = _Model(spec)
                    else:  # a new base path: its versions replace the old ones once they load
                        model.spec = spec
            for model in removed:
                log.info("model %r removed from the config: unloading", model.spec.name)
                for sv in list(model.versions.values()):
                    self._retire(sv)
            problems = []
            for spec in specs:
                model = self._models.get(spec.name)
                if model is not None:  # None: unload_all ran meanwhile
                    problems.extend(self._reconcile(model))
            return problems

    def _check_label_moves(self, specs: list[ModelSpec]) -> None:
        for spec in specs:
            model = self._models.get(spec.name)
            if model is None:
                continue
            available = model.available()
            for label, version in sorted(spec.labels.items()):
                before = model.spec.labels.get(label)
                if before is not None and before != version and version not in available:
                    raise FailedPrecondition(
                        f"Request to assign label to version {version} of model {spec.name}, which is not "
                        f"currently available for inference; the config is not applied: label {label!r} would "
                        f"move from version {before} to version {version} (available versions: {available}); "
                        f"serve version {version} first, then move the label"
                    )

    def poll(self) -> list[str]:
        """Look at every model's base path again: load new versions, unload old ones, retry failed ones."""
        with self._reconcile_lock:
            problems = []
            for model in list(self._models.values()):
                problems.extend(self._reconcile(model, quiet=True))
            return problems

    def _reconcile(self, model: _Model[S], quiet: bool = False) -> list[str]:
        spec = model.spec
        try:
            on_disk = list_versions(spec.base_path)
            if spec.model_file:  # a Triton repository: the SavedModel is a folder in the version folder
                on_disk = {v: os.path.join(path, spec.model_file) for v, path in on_disk.items()}
            model.error = None
        except LoadError as e:
            # A base path that is missing or empty for a moment (being replaced) must not unload what serves.
            if not (quiet and model.error is not None and model.error.message == e.message):
                stay = "the versions it serves stay" if model.available() else "nothing of it is served"
                log.error("model %r: %s (%s)", spec.name, e.message, stay)
            model.error = e
            return [f"model {spec.name!r}: {e.message}"]
        tried: set[int] = set()  # one load attempt per version per pass, so a pass always ends
        while True:
            now = time.monotonic()
            available = model.available()
            usable = [
                v for v, path in on_disk.items()
                if v in available or (v not in tried and self._may_load(model, v, path, now))
            ]  # fmt: skip
            wanted = spec.policy.select(usable)
            to_load = [v for v in wanted if v not in tried and self._wants_load(model, v, on_disk[v], now, available)]
            if not to_load:
                break
            for version in sorted(to_load, reverse=True):
                tried.add(version)
                self._load(model, version, on_disk[version])
        # Availability-preserving: what is wanted is loaded now; only then does the rest unload.
        for version in model.available():
            if version not in wanted:
                self._retire(model.versions[version])
        with self._lock:
            for version, sv in list(model.versions.items()):
                if sv.state == END and version not in on_disk:
                    model.versions.pop(version, None)
            for version, sv in list(model.failed_reloads.items()):
                if on_disk.get(version) != sv.path or version not in model.versions:
                    del model.failed_reloads[version]
        problems = []
        for version in tried:
            sv = model.failed_reloads.get(version) or model.versions.get(version)
            if sv is not None and sv.state == END and sv.error is not None:
                problems.append(f"model {spec.name!r} version {version} failed to load: {sv.error.message}")
        if spec.policy.kind == "specific":
            absent = sorted(v for v in spec.policy.versions if v not in on_disk)
            if absent:
                problems.append(
                    f"model {spec.name!r}: version(s) {absent} of its specific version policy are not under base "
                    f"path {spec.base_path!r} (version folders there: {sorted(on_disk)})"
                )
        available = set(model.available())
        for label, version in sorted(spec.labels.items()):
            if version not in available:
                problems.append(
                    f"model {spec.name!r}: version label {label!r} points to version {version}, which is not "
                    f"available (available versions: {sorted(available)})"
                )
        return problems

    def _wants_load(self, model: _Model[S], version: int, path: str, now: float, available: list[int]) -> bool:
        if version not in available:
            return True
        serving = model.versions[version]
        changed = serving.path != path or serving.config != model.spec.triton_config
        if not changed and self.reload_changed_files:  # files replaced in place (Triton's poll mode reloads them)
            changed = folder_fingerprint(path) != serving.fingerprint
        return changed and self._may_load(model, version, path, now)

    def _may_load(self, model: _Model[S], version: int, path: str, now: float) -> bool:
        """Whether loading ``version`` from ``path`` may be tried now: not a known failure, or one whose retry is
        due or whose files changed since."""
        sv = model.versions.get(version)
        if sv is not None and sv.state == AVAILABLE:  # a reload of the same number from a new base path or config
            sv = model.failed_reloads.get(version)
            if sv is None or sv.path != path or sv.config != model.spec.triton_config:
                return True
        if sv is None or sv.state != END or sv.error is None:
            return True
        if sv.attempts <= self.max_num_load_retries and now >= sv.retry_at:
            return True
        return folder_fingerprint(path) != sv.fingerprint  # the files changed since it failed: try again

    def _load(self, model: _Model[S], version: int, path: str) -> None:
        name = model.spec.name
        previous = model.versions.get(version)
        replacing = previous is not None and previous.state == AVAILABLE  # same number from a new base path
        record = model.failed_reloads.get(version) if replacing else previous  # earlier failures of this load
        sv = ServedVersion(
            name, version, path, attempts=record.attempts if record else 0, config=model.spec.triton_config
        )
        fingerprint = folder_fingerprint(path)
        sv.fingerprint = fingerprint
        if record is not None and (
            record.error is None or record.fingerprint != fingerprint or record.config != sv.config
        ):
            sv.attempts = 0  # not a failure, or new files or config: a fresh start
        if not replacing:
            with self._lock:
                model.versions[version] = sv
                model.ended.pop(version, None)
        again = f" (attempt {sv.attempts + 1})" if sv.attempts else ""
        log.info("model %r version %d: loading from %s%s", name, version, path, again)
        start = time.monotonic()
        try:
            servable = self._make(name, version, path)
        except Exception as e:
            error = e if isinstance(e, ServingError) else LoadError(f"{type(e).__name__}: {e}")
            sv.attempts += 1
            sv.fingerprint = fingerprint
            sv.retry_at = time.monotonic() + self.load_retry_interval_s
            with self._lock:
                sv.error, sv.state = error, END
                if replacing:  # the old files keep serving; the failure is reported by the problems
                    model.versions[version].error = error
                    model.failed_reloads[version] = sv
            self._on_load(name, version, False, time.monotonic() - start, path)
            # no promise of a retry: one comes only if the process serves on and polls (and logs its attempt)
            log.error("model %r version %d failed to load after %.2fs (attempt %d): %s", name, version,
                      time.monotonic() - start, sv.attempts, error.message)  # fmt: skip
            return
        self._on_load(name, version, True, time.monotonic() - start, path)
        with self._lock:
            closed = self._closed
            if not closed:
                sv.servable, sv.state = servable, AVAILABLE
                model.versions[version] = sv
                model.failed_reloads.pop(version, None)
        if closed:  # unload_all ran while this loaded: nobody will serve it
            sv.state = END
            self._close(servable)
            return
        if replacing:
            previous.retired = False
            self._retire_replaced(previous)
        log.info("model %r version %d: available after %.2fs", name, version, time.monotonic() - start)

    def _retire_replaced(self, sv: ServedVersion[S]) -> None:
        """Retire a version whose slot a reload of the same number has taken."""
        with self._lock:
            sv.retired = True
            close_now = sv.inflight == 0
            sv.state = UNLOADING
        if close_now:
            self._unload(sv)

    def _retire(self, sv: ServedVersion[S]) -> None:
        """Take a version out of service; it closes when its last in-flight request releases it."""
        with self._lock:
            if sv.retired:
                return
            sv.retired = True
            model = self._models.get(sv.name)
            if model is not None and model.versions.get(sv.version) is sv:
                del model.versions[sv.version]
                model.end(sv)
            close_now = sv.inflight == 0
            if sv.state == AVAILABLE:
                sv.state = UNLOADING
        if close_now:
            self._unload(sv)
        else:
            log.info("model %r version %d: unloading after %d in-flight requests", sv.name, sv.version, sv.inflight)

    def _unload(self, sv: ServedVersion[S]) -> None:
        if sv.servable is not None:
            self._close(sv.servable)
            log.info("model %r version %d: unloaded", sv.name, sv.version)
        sv.servable, sv.state = None, END

    # -- requests -------------------------------------------------------------------------------------

    def acquire(self, name: str, version: int | None = None, label: str = "") -> ServedVersion[S]:
        """Lease the requested version (by number, by label, or the highest available) for one request.

        Every acquire must be paired with ``release``; NotFound names what exists instead.
        """
        with self._lock:
            sv = self._lookup(name, version, label)
            sv.inflight += 1
            return sv

    def release(self, sv: ServedVersion[S]) -> None:
        with self._lock:
            sv.inflight -= 1
            close_now = sv.retired and sv.inflight == 0 and sv.servable is not None
        if close_now:
            self._unload(sv)

    def get(self, name: str, version: int | None = None, label: str = "") -> ServedVersion[S]:
        """Like acquire, without a lease: for answers that do not run the model (metadata, status)."""
        with self._lock:
            return self._lookup(name, version, label)

    def _model(self, name: str, tfserving: str = "") -> _Model[S]:
        """The model called ``name``, or NotFound naming those served; the lock is held. ``tfserving``: how
        TensorFlow Serving starts this error (by default as its GetModelStatus does)."""
        model = self._models.get(name)
        if model is None:
            served = ", ".join(sorted(self._models)) or "none"
            detail = f"{name!r} is not served (served models: {served})"
            # Triton's words first: Triton's own client examples look for "Request for unknown model"
            raise _not_found(
                f"Request for unknown model: {detail}",
                f"{tfserving or f'Could not find any versions of model {name}'}; {detail}",
            )
        return model

    def _lookup(self, name: str, version: int | None, label: str) -> ServedVersion[S]:
        # TensorFlow Serving's words for a servable it cannot find (its ServableRequest's DebugString)
        request = f"Latest({name})" if version is None else f"Specific({name}, {version})"
        model = self._model(name, f"Servable not found for request: {request}")
        if label:
            if label not in model.spec.labels:
                raise _unknown_label(name, label, model.spec)
            version = model.spec.labels[label]
        if version is None:
            latest = model.latest()
            if latest is None:
                reasons = [model.error.message] if model.error else []
                reasons += [f"version {v}: {sv.error.message}" for v, sv in sorted(model.versions.items()) if sv.error]
                why = f": {'; '.join(reasons)}" if reasons else ""
                raise Unavailable(f"model {name!r} has no version available yet{why}")
            return latest
        sv = model.versions.get(version)
        if sv is None or sv.state != AVAILABLE:
            available = model.available()
            what = f"version label {label!r} points to version {version}, which" if label else f"version {version}"
            if sv is not None and sv.state == END and sv.error is not None:
                raise NotFound(f"model {name!r} {what} failed to load: {sv.error.message}")
            if sv is not None and sv.state == LOADING:
                raise Unavailable(f"model {name!r} {what} is still loading (available versions: {available})")
            if label:
                raise NotFound(f"model {name!r} {what} is not available (available versions: {available})")
            message = f"model {name!r} has no version {version} (available versions: {available})"
            raise _not_found(  # Triton's words first (its clients look for them), TensorFlow Serving's on its APIs
                f"Request for unknown model: '{name}' version {version} is not found; {message}",
                f"Servable not found for request: Specific({name}, {version}); {message}",
            )
        return sv

    # -- status ---------------------------------------------------------------------------------------

    def statuses(self, name: str, version: int | None = None, label: str = "") -> list[ServedVersion[S]]:
        """Every known version of ``name`` (loading, available, failed, unloaded), lowest first, or the one asked
        for."""
        with self._lock:
            model = self._model(name)
            if label:
                if label not in model.spec.labels:
                    raise _unknown_label(name, label, model.spec)
                version = model.spec.labels[label]
            known = {**model.ended, **model.versions}
            if version is not None:
                sv = known.get(version)
                if sv is None:
                    message = f"model {name!r} has no version {version} (known: {sorted(known)})"
                    raise _not_found(message, f"Could not find version {version} of model {name}; {message}")
                return [sv]
            return [sv for _, sv in sorted(known.items())]

    def is_served(self, name: str) -> bool:
        return name in self._models

    def spec(self, name: str) -> ModelSpec:
        """How ``name`` is configured (base path, version policy, labels)."""
        with self._lock:
            return self._model(name).spec

    def model_names(self) -> list[str]:
        return sorted(self._models)

    def failed_models(self) -> list[str]:
        """Models with no version available, or with a version loading or failed (not unloaded): what keeps a
        strictly ready server unready."""
        with self._lock:
            return sorted(
                name for name, m in self._models.items()
                if not m.available()
                or any(sv.state == LOADING or (sv.state == END and sv.error is not None) for sv in m.versions.values())
            )  # fmt: skip

    def available_models(self) -> list[str]:
        with self._lock:
            return sorted(name for name, m in self._models.items() if m.available())

    def unload_all(self) -> None:
        """Unload everything (shutdown); a load still in progress closes what it makes."""
        with self._lock:
            self._closed = True
            models, self._models = self._models, {}
        for model in models.values():
            for sv in list(model.versions.values()):
                self._retire(sv)
