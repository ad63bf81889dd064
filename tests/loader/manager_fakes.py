"""Stand-ins for the ModelManager tests: a servable maker that records loads and closes, version folders."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from servex.loader import LoadError, ModelManager
from servex.loader.config import ModelSpec, VersionPolicy
from servex.loader.manager import AVAILABLE
from tests.conftest import TESTDATA

TWO_VERSIONS = TESTDATA / "saved_model_half_plus_two_2_versions"


@dataclass(eq=False)
class Servable:
    name: str
    version: int
    path: str


class Recorder:
    """make_servable / close_servable pair that records, in order, every load attempt and every close.

    ``events`` holds ("make", name, version) for a load that succeeded, ("fail", name, version) for one that
    raised LoadError, and ("close", name, version). Loads fail for the folders in ``fail_paths`` and for every
    folder while ``failing`` is set. ``on_make`` (when set) runs inside each load, before it returns.
    """

    def __init__(self):
        self.events: list[tuple[str, str, int]] = []
        self.made: list[Servable] = []
        self.closed: list[Servable] = []
        self.fail_paths: set[str] = set()
        self.failing = False
        self.on_make = None
        self._lock = threading.Lock()

    def make(self, name: str, version: int, path: str) -> Servable:
        if self.on_make is not None:
            self.on_make(name, version, path)
        if self.failing or path in self.fail_paths:
            with self._lock:
                self.events.append(("fail", name, version))
            raise LoadError(f"cannot load {path}: saved_model.pb is truncated")
        servable = Servable(name, version, path)
        with self._lock:
            self.events.append(("make", name, version))
            self.made.append(servable)
        return servable

    def close(self, servable: Servable) -> None:
        with self._lock:
            self.events.append(("close", servable.name, servable.version))
            self.closed.append(servable)

    def attempts(self, name: str, version: int) -> int:
        return sum(1 for kind, n, v in self.events if kind in ("make", "fail") and (n, v) == (name, version))


def add_version(base: Path, version: int, content: bytes = b"\x08\x01\x12\x04serve") -> Path:
    """A version folder with a small saved_model.pb (folder_fingerprint looks at the files)."""
    folder = base / str(version)
    folder.mkdir(parents=True)
    (folder / "saved_model.pb").write_bytes(content)
    (folder / "variables").mkdir()
    (folder / "variables" / "variables.index").write_bytes(b"index")
    return folder


def model_dir(root: Path, *versions: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for version in versions:
        add_version(root, version)
    return root


def spec(name: str, base: Path, policy: VersionPolicy | None = None, labels: dict[str, int] | None = None):
    return ModelSpec(name, str(base), policy or VersionPolicy(), labels or {})


def available(manager: ModelManager, name: str) -> list[int]:
    return [sv.version for sv in manager.statuses(name) if sv.state == AVAILABLE]


def made_versions(rec: Recorder, name: str = "m") -> list[int]:
    return [s.version for s in rec.made if s.name == name]


def closed_versions(rec: Recorder, name: str = "m") -> list[int]:
    return [s.version for s in rec.closed if s.name == name]
