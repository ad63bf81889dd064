"""ModelManager: which versions of which models are served, and lookup by name and version.

Generic over the servable, as TensorFlow Serving's manager is: the caller supplies ``make_servable(name,
version, path)`` (the server wires a GraphExecutor over a loaded SavedModel) and the manager keeps what it makes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from loader.errors import NotFound
from loader.versions import latest_version

log = logging.getLogger(__name__)

S = TypeVar("S")


@dataclass
class ServedVersion(Generic[S]):
    name: str
    version: int
    path: str
    servable: S
    state: str = "AVAILABLE"


class ModelManager(Generic[S]):
    def __init__(
        self, make_servable: Callable[[str, int, str], S], close_servable: Callable[[S], None] = lambda s: None
    ):
        self._make = make_servable
        self._close = close_servable
        self._lock = threading.Lock()
        self._models: dict[str, dict[int, ServedVersion[S]]] = {}

    def load_latest(self, name: str, base_path: str) -> ServedVersion[S]:
        """Load the highest-numbered version under ``base_path`` as model ``name``; raises LoadError."""
        version, path = latest_version(base_path)
        servable = self._make(name, version, path)
        served = ServedVersion(name, version, path, servable)
        with self._lock:
            replaced = self._models.setdefault(name, {}).get(version)
            self._models[name][version] = served
        if replaced is not None:
            self._close(replaced.servable)
        log.info("serving model %r version %d from %s", name, version, path)
        return served

    def get(self, name: str, version: int | None = None) -> ServedVersion[S]:
        """The requested version of ``name``, or its highest when ``version`` is None; NotFound otherwise."""
        versions = self._models.get(name)
        if not versions:
            served = ", ".join(sorted(self._models)) or "none"
            raise NotFound(f"model {name!r} is not served (served models: {served})")
        if version is None:
            return versions[max(versions)]
        found = versions.get(version)
        if found is None:
            raise NotFound(f"model {name!r} has no version {version} (available versions: {sorted(versions)})")
        return found

    def versions(self, name: str) -> list[ServedVersion[S]]:
        """Every served version of ``name``, lowest first; NotFound for an unknown model."""
        self.get(name)
        return [v for _, v in sorted(self._models[name].items())]

    def is_served(self, name: str) -> bool:
        return name in self._models

    def model_names(self) -> list[str]:
        return sorted(self._models)

    def unload_all(self) -> None:
        with self._lock:
            models, self._models = self._models, {}
        for versions in models.values():
            for served in versions.values():
                self._close(served.servable)
