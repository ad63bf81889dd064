"""Triton's model repository extension (index, load, unload) over the served config, for every protocol: gRPC
(server/protocols/kserve/grpc_api.py, ``RepositoryService`` on the admin port, and ``KServeService`` on the main port
in explicit model
control of a Triton model repository) and REST (server/protocols/kserve/rest_api.py, ``/v2/repository/...``, there in
that mode).

Load adds a model to the served config (``lifecycle.specs``, applied by ``lifecycle.apply``) and answers once it
is served; unload takes it out (in-flight requests finish first). With Triton model repositories, models are loaded
by name from them (the folder read again at each load, as Triton reloads it), only in explicit model control, as in
Triton; otherwise a model is known from the config, unloaded earlier, or at a ``base_path``.
"""

from __future__ import annotations

import asyncio

from servex.loader.config import ModelSpec
from servex.loader.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from servex.loader.manager import AVAILABLE, END, LOADING, UNLOADING

BASE_PATH = "base_path"  # the load parameter naming a folder of version folders
RESTRICTION_FLAGS = {"grpc": "grpc-restricted-protocol", "http": "http-restricted-api"}  # Triton's
# ModelManager states -> the repository index's
_INDEX_STATES = {AVAILABLE: "READY", LOADING: "LOADING", UNLOADING: "UNLOADING"}


class ModelRepository:
    def __init__(self, core, lifecycle):
        self.core = core
        self.lifecycle = lifecycle
        self.unloaded: dict[str, ModelSpec] = {}  # models unloaded here, loadable again by name (under lifecycle.lock)

    def check_access(self, protocol: str, headers) -> None:
        """On the inference ports: PermissionDenied unless the call carries the header Triton's
        --grpc-restricted-protocol / --http-restricted-api ask of the model-repository category (``protocol``:
        "grpc" or "http"; ``headers``: (key, value) pairs). The admin port has its own token instead."""
        restriction = self.lifecycle.settings.repository_restrictions.get(protocol)
        if restriction is None:
            return
        key, value = restriction
        if not any(k.lower() == key and v == value for k, v in headers):
            raise PermissionDenied(f"the model repository extension is restricted: it expects header {key!r} with "
                                   f"the value it was given (--{RESTRICTION_FLAGS[protocol]})")  # fmt: skip

    def check(self, name: str, action: str) -> None:
        """What every load or unload needs first: a model name, and a model control that allows it."""
        if not name:
            raise InvalidArgument(f"model_name is empty: name the model to {action}")
        self._follows_repository()

    def check_parameters(self, name: str, names) -> None:
        """InvalidArgument for load parameters servex does not take: ``base_path`` alone, and none with Triton
        model repositories (Triton's ``config`` and ``file:...`` overrides are not supported)."""
        taken = set() if self.lifecycle.settings.model_repositories else {BASE_PATH}
        unsupported = sorted(set(names) - taken)
        if unsupported:
            supported = f"[{BASE_PATH!r}]" if taken else "none (models load by name from the model repositories)"
            raise InvalidArgument(
                f"failed to load {name!r}: parameter(s) {unsupported} are not supported; supported: {supported}"
            )

    @staticmethod
    def check_name(repository: str) -> None:
        if repository:
            raise NotFound(f'repository {repository!r} does not exist: servex has one repository, named ""')

    def _follows_repository(self) -> None:
        """With a Triton model repository, models are loaded and unloaded by name only in explicit model control
        mode, as in Triton; otherwise the repository's folders decide."""
        settings = self.lifecycle.settings
        if settings.model_repositories and settings.model_control_mode != "explicit":
            raise FailedPrecondition(
                f"the models follow the model repositories (--model-control-mode={settings.model_control_mode}): "
                f"loading and unloading by name needs --model-control-mode=explicit, as in Triton"
            )

    async def index(self, ready: bool) -> list[dict[str, str]]:
        """Every model version servex knows (only those serving with ``ready``), as (name, version, state, reason);
        models unloaded here, and a repository's models never loaded (the name alone)."""
        manager = self.core.manager
        entries = []
        for name in manager.model_names():
            try:
                versions = manager.statuses(name)
            except NotFound:  # removed meanwhile
                continue
            for sv in versions:
                state = _INDEX_STATES.get(sv.state, "UNAVAILABLE")
                if ready and state != "READY":
                    continue
                reason = sv.error.message if sv.error is not None else "unloaded" if sv.state == END else ""
                entries.append({"name": name, "version": str(sv.version), "state": state, "reason": reason})
        if not ready:
            for name in sorted(self.unloaded):
                entries.append({"name": name, "version": "", "state": "UNAVAILABLE", "reason": "unloaded"})
            if self.lifecycle.settings.model_repositories:
                listed = set(manager.model_names()) | set(self.unloaded)
                names = await asyncio.get_running_loop().run_in_executor(None, self.lifecycle.repository_names)
                entries.extend(
                    {"name": name, "version": "", "state": "", "reason": ""} for name in names if name not in listed
                )
        return entries

    async def load(self, name: str, base_path: str | None = None) -> None:
        """Serve ``name`` (from ``base_path`` when given); returns once it serves, else FailedPrecondition saying
        why. A caller that goes away (a deadline) does not cut the change short."""
        self.check(name, "load")
        self.check_parameters(name, [BASE_PATH] if base_path is not None else [])
        await _finish(self._load(name, base_path))

    async def _load(self, name: str, base_path: str | None) -> None:
        settings = self.lifecycle.settings
        async with self.lifecycle.lock:
            specs = {spec.name: spec for spec in self.lifecycle.specs}
            if base_path is not None:
                spec = ModelSpec(name, base_path)
            elif settings.model_repositories:
                # Read again from the repositories (its config.pbtxt may have changed), as Triton reloads it.
                loop = asyncio.get_running_loop()
                spec = await loop.run_in_executor(None, self.lifecycle.repository_model, name)
                if spec is None:
                    raise NotFound(f"failed to load {name!r}: no model {name!r} in any model repository "
                                   f"({', '.join(settings.model_repositories)})")  # fmt: skip
            else:
                spec = specs.get(name) or self.unloaded.get(name)
                if spec is None:
                    known = ", ".join(sorted(set(specs) | set(self.unloaded))) or "none"
                    raise NotFound(
                        f"failed to load {name!r}: model {name!r} is not in the repository (known models: {known}); "
                        f"send parameter {BASE_PATH!r} to load it from a folder of version folders"
                    )
            specs[name] = spec
            problems = await self.lifecycle.apply_held(list(specs.values()))
            self.unloaded.pop(name, None)
        mine = [p for p in problems if p.startswith(f"model {name!r}")]
        if mine or name not in self.core.manager.available_models():
            raise FailedPrecondition(
                f"failed to load {name!r}: model {name!r} is in the repository but did not load: "
                f"{'; '.join(mine) or 'no version available'}"
            )

    async def unload(self, name: str) -> None:
        self.check(name, "unload")
        await _finish(self._unload(name))

    async def _unload(self, name: str) -> None:
        async with self.lifecycle.lock:
            specs = {spec.name: spec for spec in self.lifecycle.specs}
            spec = specs.pop(name, None)
            if spec is None:
                served = ", ".join(sorted(specs)) or "none"
                raise NotFound(f"Request for unknown model: {name!r} is not served (served models: {served})")
            await self.lifecycle.apply_held(list(specs.values()))
            self.unloaded[name] = spec


async def _finish(change) -> None:
    """Await a config change that finishes even if its caller is cancelled (a client's deadline): the served config,
    health and the index stay in step. Its error reaches a caller still waiting (and is marked retrieved for one
    that has gone: the outcome shows in the index and the log)."""
    task = asyncio.ensure_future(change)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: never "never retrieved"
    await asyncio.shield(task)
