"""The servex process: load the model, serve gRPC (TensorFlow Serving API, health, reflection) and /metrics,
drain on SIGTERM/SIGINT.

Start-up order: the gRPC port opens first with health NOT_SERVING, the model loads off the event loop, then
health turns SERVING. Shutdown: health NOT_SERVING, no new calls, in-flight calls finish (up to
``drain_seconds``), workers stop, exit 0.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
from pathlib import Path

import grpc
import tensorflow as tf
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tensorflow_serving.apis import (
    model_service_pb2,
    model_service_pb2_grpc,
    prediction_service_pb2,
    prediction_service_pb2_grpc,
)

from servex.executor import GraphExecutor, RunHandler
from servex.executor.metrics import CacheMetrics, VariableMetrics
from servex.loader import ModelManager, load_saved_model
from servex.loader.config import ModelSpec, parse_model_config
from servex.loader.errors import InvalidArgument, ServingError
from servex.loader.model_repository import read_repositories
from servex.protos.servex.v1 import graph_executor_pb2, graph_executor_pb2_grpc, variables_pb2_grpc
from servex.server.affinity import LoopPin
from servex.server.config.batching import batching_options, per_model_batching
from servex.server.config.settings import ServerSettings
from servex.server.core import ServingCore
from servex.server.cores import usable_cores
from servex.server.observability.metrics import model_load, register_triton_names, start_metrics_server, watch_loop_lag
from servex.server.protocols.kserve import v2_config
from servex.server.protocols.kserve.dataplane import DataPlane
from servex.server.protocols.kserve.repository import ModelRepository
from servex.server.protocols.kserve.v2_settings import LogSettings
from servex.server.protocols.servex.admin import BearerTokenInterceptor, VariableService
from servex.server.protocols.servex.graph_service import GraphExecutorService
from servex.server.protocols.tfserving.grpc_api import ModelService, PredictionService, SessionService
from servex.server.transport import tls
from servex.server.transport.http import RestServer
from servex.server.transport.listeners import ListenerGroup, refuse_if_served
from servex.server.warmup import Warmup
from servex.transfer import DeviceError, make_factory

log = logging.getLogger("servex")


def session_config(settings: ServerSettings) -> tf.compat.v1.ConfigProto:
    """Every version's session config: --tensorflow_session_config_file's ConfigProto (if any), with the thread
    pools and GPU memory share of the settings over it, and soft placement on. With --device=cpu, no GPU (unless
    the file's device_count names GPUs)."""
    config = tf.compat.v1.ConfigProto.FromString(settings.tensorflow_session_config)  # empty: the defaults
    config.intra_op_parallelism_threads = thread_pool_size(settings.tensorflow_intra_op_parallelism)
    config.inter_op_parallelism_threads = thread_pool_size(settings.tensorflow_inter_op_parallelism)
    config.allow_soft_placement = True
    if settings.per_process_gpu_memory_fraction:
        config.gpu_options.per_process_gpu_memory_fraction = settings.per_process_gpu_memory_fraction
    if settings.device == "cpu" and "GPU" not in config.device_count:  # CUDA is never initialised (or logged)
        config.device_count["GPU"] = 0
    return config


def thread_pool_size(setting: int) -> int:
    """A TensorFlow thread pool's size: the setting, or for 0 the cores servex may use (TensorFlow's own 0 counts
    the CPU affinity but not a cgroup's quota)."""
    return setting or usable_cores()


def size_thread_pools(settings: ServerSettings) -> int:
    """Size TensorFlow's process-wide thread pools before anything uses them (the first session or eager context
    fixes the intra-op pool for the process); returns the intra-op threads."""
    intra = thread_pool_size(settings.tensorflow_intra_op_parallelism)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(thread_pool_size(settings.tensorflow_inter_op_parallelism))
    except RuntimeError:  # TensorFlow's context already started (in-process tests): sessions still ask for these
        pass
    return intra


def make_manager(settings: ServerSettings, warmup: Warmup | None = None) -> ModelManager[GraphExecutor]:
    config = session_config(settings)
    transfer = make_factory(settings.device)  # DeviceError when the device cannot be used here
    log.info("transfer executor: %s", transfer.device)

    manager: ModelManager[GraphExecutor] | None = None  # set below; make() reads a model's Triton config there

    def make(name: str, version: int, path: str) -> GraphExecutor:
        model = load_saved_model(
            path,
            tags=settings.saved_model_tags,
            session_config=config,
            lazy_restore=settings.lazy_restore,
            device=settings.device,
            transfer=transfer,
            hooks=VariableMetrics(name, str(version)),
        )
        try:
            triton = manager.spec(name).triton_config
            model_config = None
            if triton is not None:  # a Triton repository's config.pbtxt: checked against the SavedModel, completed
                model_config = v2_config.load_config(
                    name, triton, model, settings.triton_auto_complete, settings.triton_default_max_batch_size
                )
                batching = v2_config.batching(model_config)
            else:
                batching = per_model_batching(settings, path)  # a bad file fails the load, naming the file
        except (OSError, ServingError):
            model.close()
            raise
        prefetch(name, version, model, settings.prefetch_variables.get(name, ()))
        executor = GraphExecutor(
            model,
            transfer=transfer,
            run_in_caller_thread=settings.run_in_caller_thread,
            max_entries=settings.client_graph_cache_size,
            metrics=CacheMetrics(name, str(version)),
        )
        executor.batching = batching
        executor.model_config = model_config  # a Triton repository model's effective config (ModelConfig answers it)
        if warmup is not None:
            try:
                warmup(name, version, path, executor)  # before the version serves
            except BaseException:
                executor.close()
                raise
        return executor

    manager = ModelManager(
        make,
        GraphExecutor.close,
        max_num_load_retries=settings.max_num_load_retries,
        load_retry_interval_s=settings.load_retry_interval_micros / 1e6,
        on_load=model_load,
    )
    manager.reload_changed_files = bool(settings.model_repositories) and settings.model_control_mode == "poll"
    return manager


def prefetch(name: str, version: int, model, names: tuple[str, ...]) -> None:
    """Restore these variables in the background, right after the version loaded."""
    if not names:
        return
    store = model.variables
    unknown = [n for n in names if n not in store.records]
    if unknown:
        log.warning("model %r version %d: no variable(s) %s to prefetch", name, version, unknown)
    pending = store.ensure([n for n in names if n in store.records])
    if pending is not None:
        log.info("model %r version %d: prefetching %d variable(s)", name, version, len(names) - len(unknown))
        pending.add_done_callback(
            lambda f: (
                f.exception() and log.error("model %r version %d: prefetch failed: %s", name, version, f.exception())
            )
        )


def start_admin_server(
    settings: ServerSettings,
    core: ServingCore,
    options,
    repository: ModelRepository | None = None,
    certificates: tls.Certificates | None = None,
    plane: DataPlane | None = None,
) -> grpc.aio.Server | None:
    """The admin port (VariableService; with ``repository``, the KServe v2 repository extension), or None when off;
    over TLS with ``certificates`` (--ssl_config_file)."""
    if not settings.admin_port:
        return None
    interceptors = []
    if settings.admin_token_file:
        token = Path(settings.admin_token_file).read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"admin token file {settings.admin_token_file!r} is empty")
        interceptors.append(BearerTokenInterceptor(token))
    server = grpc.aio.server(options=options, interceptors=interceptors)
    variables_pb2_grpc.add_VariableServiceServicer_to_server(VariableService(core, settings.max_message_bytes), server)
    if repository is not None:
        from servex.server.protocols.kserve import (
            grpc_api as kserve,  # not at module level: see server/protocols/kserve/grpc_api.py
        )

        kserve.add_repository_to_server(plane or DataPlane(core), repository, server)
    address = f"{settings.admin_bind_address}:{settings.admin_port}"
    try:
        bound = bind(server, address, certificates)
    except RuntimeError as e:  # grpcio raises where it cannot bind (older versions returned 0)
        raise OSError(f"cannot bind the admin port to {address}: {e}") from None
    if bound == 0:
        raise OSError(f"cannot bind the admin port to {address}")
    log.info("admin API on %s (%s%s)", address, "bearer token required" if interceptors else "loopback only",
             ", TLS" if settings.grpc_tls else "")  # fmt: skip
    return server


def bind(server, address: str, certificates: tls.Certificates | None) -> int:
    """Bind ``server`` (gRPC: a server or a ListenerGroup) to ``address``, over TLS with ``certificates``; the port
    bound."""
    if certificates is None:
        return server.add_insecure_port(address)
    if isinstance(server, ListenerGroup):
        return server.add_secure_port(address, certificates.credentials)  # each listener its own
    return server.add_secure_port(address, certificates.credentials())


def settle_heap() -> int:
    """Collect the garbage of start-up, then freeze what survives (TensorFlow's graphs, modules, the loaded
    models): the cyclic collector never scans those objects again. Without this, each full collection walks
    every one of them on the event loop: a 150 ms stall every few seconds under load (max latency 160 ms at
    32 callers on the MLP, 15 ms with it). Objects made later (models loaded afterwards) are collected as usual.
    Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


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


async def serve(settings: ServerSettings) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    options = {
        "grpc.max_receive_message_length": settings.max_message_bytes,
        "grpc.max_send_message_length": settings.max_message_bytes,
        "grpc.so_reuseport": 0,  # the admin port; the listeners set their own
    }
    options = list({**options, **dict(settings.grpc_channel_arguments)}.items())  # the user's win
    # Alone, a port already in use must fail the start; several serving processes share theirs.
    server = ListenerGroup(settings.grpc_listeners, options, shared_port=settings.process_group_size > 1)
    try:
        batching = batching_options(settings)
    except (OSError, InvalidArgument) as e:
        log.error("%s", e)
        return 1
    intra_op_threads = size_thread_pools(settings)
    run_handler = RunHandler(
        settings.num_run_workers,
        intra_op_threads=intra_op_threads,
        max_queued_per_model=settings.max_queued_requests,
        max_queued_bytes=settings.max_queued_bytes,
        aging_seconds=settings.priority_aging_ms / 1000,
        batching=batching,
        hold_seconds=settings.result_hold_micros / 1e6,
        lower_priority_burst=settings.lower_priority_burst,
        max_padded_batch_bytes=settings.max_message_bytes,
    )
    warmup = None
    if settings.enable_model_warmup:
        warmup = Warmup(
            loop,
            run_handler,
            iterations=settings.num_request_iterations_for_warmup,
            pin_signature_graphs=settings.pin_signature_graphs,
            max_tensor_bytes=settings.max_message_bytes,
        )
    try:
        manager = make_manager(settings, warmup)
    except DeviceError as e:  # --device unknown or not usable here (no CuPy, no GPU): fail at start
        log.error("%s", e)
        run_handler.close()
        return 1
    core = ServingCore(manager, run_handler, settings.pin_signature_graphs, settings.max_message_bytes)
    core.strict_readiness = settings.strict_readiness
    # KServe v2's data plane, both transports': Triton's shared memory, log settings and repository extension
    plane = DataPlane(core, log_settings=LogSettings(settings.process_group_size))
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionService(core, settings.tensor_content_outputs, settings.max_message_bytes), server
    )
    SessionService(core, settings.tensor_content_outputs, settings.max_message_bytes).add_to_server(server)
    graph_executor_pb2_grpc.add_GraphExecutorServicer_to_server(
        GraphExecutorService(core, settings.max_message_bytes), server
    )
    from servex.server.protocols.kserve import (
        grpc_api as kserve,  # not at module level: its inference.* protos clash with tritonclient's in one process
    )

    health_servicer = health.aio.HealthServicer()
    lifecycle = Lifecycle(manager, health_servicer, settings)
    repository = ModelRepository(core, lifecycle)  # the repository extension, one for every port serving it
    # On the admin port; on the main ports too in explicit model control of a Triton model repository, as Triton
    # serves it (loads by name from the repositories only).
    explicit = bool(settings.model_repositories) and settings.model_control_mode == "explicit"
    plane.repository = repository if explicit else None  # the main ports' (gRPC and REST)
    kserve.add_to_server(plane, server, settings.max_message_bytes)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(
        ModelService(core, lifecycle.apply, settings.process_group_size), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [
            prediction_service_pb2.DESCRIPTOR.services_by_name["PredictionService"].full_name,
            model_service_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
            SessionService.SERVICE,
            graph_executor_pb2.DESCRIPTOR.services_by_name["GraphExecutor"].full_name,
            kserve.SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    address = f"{settings.bind_address}:{settings.port}"
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    ports = _Ports(settings, server, core, options, lifecycle, repository, plane)
    # Alone, servex opens its ports first (health NOT_SERVING while the models load). One of several serving
    # processes opens them once its models are in: the kernel then never hands it a connection it cannot serve.
    in_group = settings.process_group_size > 1
    if not in_group and not await ports.open():
        await loop.run_in_executor(None, run_handler.close)
        return 1
    if not in_group:  # a group's /metrics adds up the processes' files: this process's statistics are not in them
        register_triton_names()
    metrics_server = None
    if settings.metrics_port:
        try:
            metrics_server = start_metrics_server(settings.metrics_port, settings.bind_address)
        except OSError as e:
            log.error("cannot bind metrics to %s:%d: %s", settings.bind_address, settings.metrics_port, e)
            await ports.close(0)
            await loop.run_in_executor(None, run_handler.close)
            return 1

    tasks: list[asyncio.Task] = []
    pin: LoopPin | None = None
    exit_code = 0
    try:
        specs, config_text, refused = initial_specs(settings)
        lifecycle.refused.update(refused)
        problems = [reason for _, reason in sorted(refused.items())]
        load = asyncio.ensure_future(lifecycle.apply(specs))
        done, _ = await asyncio.wait([load, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if load in done:
            problems += load.result()
            for problem in problems:
                log.error("%s", problem)
            available = manager.available_models()
            core.started = True
            failed = sorted(set(refused) | set(manager.failed_models()))
            if settings.model_repositories and failed and settings.exit_on_error:
                log.error("model(s) %s did not load, and --exit-on-error is true (Triton's default): exiting",
                          ", ".join(failed))  # fmt: skip
                exit_code = 1
            elif not available and not settings.model_repositories:  # a repository may start empty, as Triton's
                log.error("no model loaded, nothing to serve: %s", "; ".join(problems) or "no model configured")
                exit_code = 1
            elif in_group and not await ports.open():
                exit_code = 1
            else:
                tasks.append(asyncio.ensure_future(watch_loop_lag()))
                if settings.file_system_poll_wait_seconds > 0:
                    tasks.append(asyncio.ensure_future(lifecycle.poll_files()))
                if settings.model_config_file and settings.model_config_file_poll_wait_seconds > 0:
                    tasks.append(asyncio.ensure_future(lifecycle.poll_config(config_text)))
                if settings.model_repositories and settings.model_control_mode == "poll":
                    tasks.append(asyncio.ensure_future(lifecycle.poll_repositories()))
                log.info("froze %d start-up objects out of the garbage collector's scans", settle_heap())
                if settings.event_loop_cpu >= 0:
                    pin = LoopPin(settings.event_loop_cpu)
                    pin.pin()
                log.info("servex ready on %s, serving %s", address, ", ".join(available) or "no model yet")
                await stop.wait()
    except (OSError, InvalidArgument) as e:
        log.error("cannot read the models to serve, nothing to serve: %s", e)
        exit_code = 1
    for task in tasks:
        task.cancel()
    if pin is not None:
        pin.unpin()

    log.info("draining: no new calls, in-flight calls have %.0fs to finish", settings.drain_seconds)
    await health_servicer.enter_graceful_shutdown()
    await ports.close(settings.drain_seconds)
    await loop.run_in_executor(None, run_handler.close)  # queued runs finish; the loop stays responsive
    manager.unload_all()
    if metrics_server is not None:
        metrics_server.shutdown()
    log.info("servex stopped")
    return exit_code


class _Ports:
    """The gRPC, admin and REST ports of one process: opened together, closed together (draining)."""

    def __init__(
        self, settings: ServerSettings, server, core: ServingCore, options, lifecycle: Lifecycle, repository, plane
    ):
        self.settings, self.server, self.core, self.options, self.lifecycle = settings, server, core, options, lifecycle
        self.plane = plane  # KServe v2's data plane, shared by its gRPC and REST adapters
        self.repository = repository  # the repository extension on the admin port
        self.admin = None
        self.rest = None
        self.opened = False
        # TLS of the gRPC ports (--ssl_config_file or the PEM file flags): one per process, following the files
        self.certificates = tls.Certificates(settings.grpc_tls) if settings.grpc_tls else None

    async def open(self) -> bool:
        """Bind and start every port; False (logged, nothing left open) when one cannot bind."""
        settings = self.settings
        address = f"{settings.bind_address}:{settings.port}"
        try:
            bind(self.server, address, self.certificates)
        except (OSError, RuntimeError) as e:  # taken by another process (probe), or gRPC could not bind
            log.error("cannot bind gRPC to %s: %s", address, e)
            return False
        if settings.grpc_socket_path:
            address += f" and unix:{settings.grpc_socket_path}"
            try:  # one listener serves the socket: UNIX sockets have no SO_REUSEPORT spreading
                refuse_if_served(settings.grpc_socket_path)
                bind(self.server.servers[0], f"unix:{settings.grpc_socket_path}", self.certificates)
            except (OSError, RuntimeError) as e:
                log.error("cannot bind gRPC to unix:%s: %s", settings.grpc_socket_path, e)
                return False
        try:
            self.admin = start_admin_server(
                settings, self.core, self.options, self.repository, self.certificates, self.plane
            )
        except (OSError, ValueError) as e:
            log.error("%s", e)
            return False
        await self.server.start()
        self.opened = True
        if self.admin is not None:
            await self.admin.start()
        log.info("gRPC on %s (%d listeners%s)", address, len(self.server.servers),
                 ", TLS" + (", client certificates required" if settings.grpc_tls.client_verify else "")
                 if settings.grpc_tls else "")  # fmt: skip
        if settings.rest_api_port:
            # not at module level: KServe's modules bring the inference.* messages (see protocols/kserve/grpc_api.py)
            from servex.server.protocols.kserve import rest_api as kserve_rest
            from servex.server.protocols.tfserving import rest_api as tfserving_rest

            timeout_s = settings.rest_api_timeout_in_ms / 1000
            args = (settings.rest_api_port, settings.bind_address, settings.max_message_bytes, timeout_s)
            self.rest = RestServer(
                self.core,
                *args,
                settings.drain_seconds,
                reuse_port=settings.process_group_size > 1,
                prometheus_path=settings.prometheus_rest_path,
                cors=settings.rest_api_enable_cors_support,
                batching=settings.enable_batching,
                routes=(functools.partial(kserve_rest.add_routes, plane=self.plane), tfserving_rest.add_routes),
            )
            try:
                await self.rest.start()
            except OSError as e:
                log.error("cannot bind REST to %s:%d: %s", settings.bind_address, settings.rest_api_port, e)
                self.rest = None
                await self.close(0)
                return False
        return True

    async def close(self, grace: float) -> None:
        if not self.opened:
            return
        await asyncio.gather(self.server.stop(grace), *([self.rest.stop()] if self.rest is not None else []))
        if self.admin is not None:
            await self.admin.stop(1)


def run(settings: ServerSettings) -> int:
    return asyncio.run(serve(settings))
