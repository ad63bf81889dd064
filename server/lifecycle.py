"""The models a process serves, over time: the models to serve at start (a model config file, the single-model
flags, or Triton model repositories), and the Lifecycle that applies config changes and polls (base paths, the
config file, the repositories) off the event loop, with health following what is available and request logging
(server/observability/request_log.py) what each config applied says."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from grpc_health.v1 import health_pb2

from servex.loader import ModelManager
from servex.loader.config import ModelSpec, parse_model_config
from servex.loader.errors import InvalidArgument, ServingError
from servex.loader.model_repository import read_repositories
from servex.server.config.settings import ServerSettings
from servex.server.observability.request_log import LOGS

log = logging.getLogger("servex")


def initial_specs(settings: ServerSettings) -> tuple[list[ModelSpec], str, dict[str, str]]:
    """The models to serve at start, the config file's text (empty without a config file), and why each model that
    cannot be served cannot (a Triton repository's), by name."""
    if settings.model_repositories:
        specs, refused = repository_specs(settings)
        if settings.model_control_mode == "explicit":
            wanted = set(settings.load_models)
            known = {spec.name for spec in specs} | set(refused)
            unknown = sorted(wanted - known - {"*"})
            if unknown:
                raise InvalidArgument(f"--load-model {', '.join(unknown)}: no such model in the model repositories "
                                      f"(models there: {', '.join(sorted(known)) or 'none'})")  # fmt: skip
            if "*" not in wanted:
                specs = [spec for spec in specs if spec.name in wanted]
                refused = {name: reason for name, reason in refused.items() if name in wanted}
        return specs, "", refused
    if settings.model_config_file:
        text = Path(settings.model_config_file).read_text(encoding="utf-8")
        return parse_model_config(text, f"model config file {settings.model_config_file!r}"), text, {}
    return [ModelSpec(settings.model_name, settings.resolved_model_base_path())], "", {}


def repository_specs(settings: ServerSettings, quiet: bool = False) -> tuple[list[ModelSpec], dict[str, str]]:
    """The models of the Triton model repositories, and why each model that cannot be served cannot, by name; notes
    on config fields that change nothing are logged unless ``quiet``."""
    repository = read_repositories(list(settings.model_repositories))
    if not quiet:
        for note in repository.notes:
            log.warning("%s", note)
    return repository.specs, repository.refused


class Lifecycle:
    """Drives the ModelManager from the event loop: config changes and polls run on a thread, and health
    follows what is available."""

    def __init__(self, manager: ModelManager, health_servicer, settings: ServerSettings):
        self.manager = manager
        self.health = health_servicer
        self.settings = settings
        self._known: set[str] = set()
        self.specs: list[ModelSpec] = []  # the config last applied (the KServe v2 repository edits it)
        # The Triton repositories' models that cannot be served, and why (logged once each)
        self.refused: dict[str, str] = {}
        # One config change at a time (reloads, the config file's polls, the repository extension), so that specs
        # is always the config the manager serves.
        self.lock = asyncio.Lock()

    async def apply(self, specs: list[ModelSpec]) -> list[str]:
        """Serve ``specs``; the problems. Raises (FailedPrecondition) for a config refused whole, nothing changed."""
        async with self.lock:
            return await self.apply_held(specs)

    async def apply_held(self, specs: list[ModelSpec]) -> list[str]:
        """``apply``, for a caller holding ``lock`` (the repository extension edits ``specs`` under it)."""
        previous, self.specs = self.specs, list(specs)
        try:
            problems = await asyncio.get_running_loop().run_in_executor(None, self.manager.apply_config, specs)
        except ServingError:
            self.specs = previous
            raise
        LOGS.update(specs)  # the models' logging_config, in effect from now on
        await self.sync_health()
        return problems

    async def sync_health(self) -> None:
        available = set(self.manager.available_models())
        self._known |= set(self.manager.model_names())
        Status = health_pb2.HealthCheckResponse
        for name in sorted(self._known):
            await self.health.set(name, Status.SERVING if name in available else Status.NOT_SERVING)
        await self.health.set("", Status.SERVING if available else Status.NOT_SERVING)

    async def poll_files(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.settings.file_system_poll_wait_seconds)
            try:
                await loop.run_in_executor(None, self.manager.poll)
            except Exception:  # a poll that fails must not end polling: log it, look again next time
                log.exception("polling the model base paths failed")
            await self.sync_health()

    async def poll_repositories(self) -> None:
        """Triton's poll mode: read the model repositories again every ``file_system_poll_wait_seconds`` and serve
        what they hold: models added, removed, or with a changed config.pbtxt (new and removed versions come from
        ``poll_files``). A served model whose folder cannot be served now (a config.pbtxt being edited) keeps
        serving as it was."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.settings.file_system_poll_wait_seconds)
            try:
                specs, refused = await loop.run_in_executor(None, repository_specs, self.settings, True)
            except (OSError, InvalidArgument) as e:
                log.error("model repositories not read again, the models stay as they are: %s", e)
                continue
            for name, reason in sorted(refused.items()):
                if self.refused.get(name) != reason:
                    log.error("%s", reason)
            self.refused.clear()
            self.refused.update(refused)
            current = {spec.name: spec for spec in self.specs}
            wanted = {spec.name: spec for spec in specs}
            wanted.update({name: current[name] for name in refused if name in current})
            if wanted == current:
                continue
            log.info("model repositories changed: serving %s", ", ".join(sorted(wanted)) or "no model")
            try:
                for problem in await self.apply(list(wanted.values())):
                    log.error("%s", problem)
            except Exception:  # keep polling
                log.exception("applying the model repositories' changes failed")

    def repository_names(self) -> list[str]:
        """The names of the models the Triton model repositories hold now (servable or not)."""
        specs, refused = repository_specs(self.settings, quiet=True)
        return sorted({spec.name for spec in specs} | set(refused))

    def repository_model(self, name: str) -> ModelSpec | None:
        """Model ``name`` as the Triton model repositories hold it now (None: not there, or no repositories);
        InvalidArgument when it cannot be served."""
        if not self.settings.model_repositories:
            return None
        specs, refused = repository_specs(self.settings, quiet=True)
        if name in refused:
            raise InvalidArgument(refused[name])
        return next((spec for spec in specs if spec.name == name), None)

    async def poll_config(self, text: str) -> None:
        path = self.settings.model_config_file
        while True:
            await asyncio.sleep(self.settings.model_config_file_poll_wait_seconds)
            try:
                new_text = Path(path).read_text(encoding="utf-8")
                if new_text == text:
                    continue
                specs = parse_model_config(new_text, f"model config file {path!r}", replacing=True)
            except (OSError, InvalidArgument) as e:
                log.error("model config file %r not applied, the current models stay: %s", path, e)
                continue
            log.info("model config file %r changed: applying", path)
            try:
                for problem in await self.apply(specs):
                    log.error("%s", problem)
            except ServingError as e:  # refused whole: the models stay as they were; tried again at the next poll,
                # as TensorFlow Serving re-applies the file each time (a label moved to a version still to come)
                log.error("model config file %r not applied, the current models stay: %s", path, e)
                continue
            except Exception:  # keep watching the file
                log.exception("applying model config file %r failed", path)
            text = new_text
