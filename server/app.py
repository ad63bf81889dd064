"""The servex process: load the model, serve gRPC (TensorFlow Serving API, health, reflection) and /metrics,
drain on SIGTERM/SIGINT.

Start-up order: the gRPC port opens first with health NOT_SERVING, the model loads off the event loop, then
health turns SERVING. Shutdown: health NOT_SERVING, no new calls, in-flight calls finish (up to
``drain_seconds``), workers stop, exit 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from importlib import metadata

import tensorflow as tf
from grpc_health.v1 import health, health_pb2

from servex.executor import GraphExecutor, RunHandler
from servex.executor.memory import MEMORY
from servex.executor.metrics import CacheMetrics, VariableMetrics
from servex.loader import ModelManager, load_saved_model
from servex.loader.config import ModelSpec
from servex.loader.errors import InvalidArgument, ServingError
from servex.server import group
from servex.server.affinity import LoopPin
from servex.server.config.batching import batching_options, per_model_batching
from servex.server.config.settings import ServerSettings
from servex.server.core import ServingCore
from servex.server.cores import cgroup_memory_limit, usable_cores
from servex.server.lifecycle import Lifecycle, initial_specs
from servex.server.observability import tracing
from servex.server.observability.metrics import model_load, register_triton_names, start_metrics_server, watch_loop_lag
from servex.server.observability.trace_settings import parse_trace_config
from servex.server.ports import Ports, add_grpc_services, grpc_options, port_clash
from servex.server.protocols.kserve import v2_config
from servex.server.protocols.kserve.dataplane import DataPlane
from servex.server.protocols.kserve.repository import ModelRepository
from servex.server.protocols.kserve.v2_settings import LogSettings
from servex.server.transport.listeners import ListenerGroup
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
            xla=settings.xla,
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


def settle_heap() -> int:
    """Collect the garbage of start-up, then freeze what survives (TensorFlow's graphs, modules, the loaded
    models): the cyclic collector never scans those objects again. Without this, each full collection walks
    every one of them on the event loop: a 150 ms stall every few seconds under load (max latency 160 ms at
    32 callers on the MLP, 15 ms with it). Objects made later (models loaded afterwards) are collected as usual.
    Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def start_line(settings: ServerSettings, specs: list[ModelSpec]) -> str:
    """The first line a start logs: what servex serves, from where, and on which ports."""
    try:
        version = metadata.version("servex")
    except metadata.PackageNotFoundError:
        version = "(unknown version)"
    if settings.model_repositories:
        what = f"the Triton model repositories {', '.join(settings.model_repositories)}"
    else:
        what = ", ".join(f"{spec.name!r} from {spec.base_path}" for spec in specs) or "no model"
    ports = [f"gRPC {settings.bind_address}:{settings.port}"]
    if settings.rest_api_port:
        ports.append(f"REST {settings.bind_address}:{settings.rest_api_port}")
    if settings.metrics_port:
        ports.append(f"metrics {settings.bind_address}:{settings.metrics_port}")
    if settings.admin_port:
        ports.append(f"admin {settings.admin_bind_address}:{settings.admin_port}")
    return f"servex {version}: serving {what}; {', '.join(ports)}"


def configure_memory(settings: ServerSettings) -> None:
    """The memory this process admits work against (executor/memory.py): --max_memory_bytes, else the cgroup's
    limit; serving processes share it equally."""
    limit, source = settings.max_memory_bytes, "--max_memory_bytes"
    if not limit:
        limit, source = cgroup_memory_limit() or 0, "the cgroup's memory limit"
    share = settings.process_group_size
    if limit and share > 1:
        limit, source = limit // share, f"a 1/{share} share of {source} ({limit} bytes), one per serving process"
    MEMORY.configure(limit, source)
    if limit:
        log.info("memory: admitting work against %d bytes (%s)", limit, source)


def make_run_handler(settings: ServerSettings, batching) -> RunHandler:
    return RunHandler(
        settings.num_run_workers,
        intra_op_threads=size_thread_pools(settings),
        max_queued_per_model=settings.max_queued_requests,
        max_queued_bytes=settings.max_queued_bytes,
        aging_seconds=settings.priority_aging_ms / 1000,
        batching=batching,
        hold_seconds=settings.result_hold_micros / 1e6,
        lower_priority_burst=settings.lower_priority_burst,
        max_padded_batch_bytes=settings.max_message_bytes,
        compute_bound_runs=settings.auto_compute_bound_runs,
    )


class Process:
    """One serving process's parts, made in order: the run handler, the model manager, the ServingCore and
    KServe's data plane, the lifecycle, the gRPC services and the ports."""

    def __init__(self, settings: ServerSettings, loop: asyncio.AbstractEventLoop, batching):
        self.settings = settings
        tracing.configure(parse_trace_config(settings.trace_config))  # checked by the CLI
        configure_memory(settings)
        self.run_handler = make_run_handler(settings, batching)
        warmup = None
        if settings.enable_model_warmup:
            warmup = Warmup(loop, self.run_handler, iterations=settings.num_request_iterations_for_warmup,
                            pin_signature_graphs=settings.pin_signature_graphs,
                            max_tensor_bytes=settings.max_message_bytes)  # fmt: skip
        try:
            self.manager = make_manager(settings, warmup)
        except DeviceError:  # --device unknown or not usable here (no CuPy, no GPU): fail at start
            self.run_handler.close()
            raise
        core = ServingCore(self.manager, self.run_handler, settings.pin_signature_graphs, settings.max_message_bytes)
        core.strict_readiness = settings.strict_readiness
        self.core = core
        # KServe v2's data plane, both transports': Triton's shared memory, log settings and repository extension
        self.plane = DataPlane(core, log_settings=LogSettings(settings.process_group_size))
        self.health = health.aio.HealthServicer()
        self.lifecycle = Lifecycle(self.manager, self.health, settings)
        repository = ModelRepository(core, self.lifecycle)  # the repository extension, one for every port serving it
        # On the admin port; on the main ports too in explicit model control of a Triton model repository, as
        # Triton serves it (loads by name from the repositories only).
        explicit = bool(settings.model_repositories) and settings.model_control_mode == "explicit"
        self.plane.repository = repository if explicit else None  # the main ports' (gRPC and REST)
        options = grpc_options(settings)
        # Alone, a port already in use must fail the start; several serving processes share theirs.
        server = ListenerGroup(settings.grpc_listeners, options, shared_port=settings.process_group_size > 1)
        add_grpc_services(server, settings, core, self.plane, self.lifecycle, self.health)
        self.ports = Ports(settings, server, core, options, self.lifecycle, repository, self.plane)
        self.metrics_server = None

    async def open_metrics(self) -> bool:
        settings = self.settings
        if not settings.metrics_port:
            return True
        try:
            self.metrics_server = start_metrics_server(settings.metrics_port, settings.bind_address)
        except OSError as e:
            log.error("%s", port_clash("--metrics_port", "metrics", settings.bind_address, settings.metrics_port, e))
            return False
        return True

    async def load(self, specs: list[ModelSpec], refused: dict[str, str], stop: asyncio.Event) -> bool | None:
        """Load the models to serve at start: True when servex may serve, False when it must exit 1 (logged),
        None when stopped first."""
        settings, manager = self.settings, self.manager
        self.lifecycle.refused.update(refused)
        problems = [reason for _, reason in sorted(refused.items())]
        load = asyncio.ensure_future(self.lifecycle.apply(specs))
        done, _ = await asyncio.wait([load, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if load not in done:
            return None
        problems += load.result()
        for problem in problems:
            log.error("%s", problem)
        self.core.started = True
        failed = sorted(set(refused) | set(manager.failed_models()))
        if settings.model_repositories and failed and settings.exit_on_error:
            log.error("model(s) %s did not load, and --exit-on-error is true (Triton's default): exiting",
                      ", ".join(failed))  # fmt: skip
            return False
        if not manager.available_models() and not settings.model_repositories:  # a repository may start empty
            log.error("no model loaded, nothing to serve: %s", "; ".join(problems) or "no model configured")
            return False
        return True

    def background_tasks(self, config_text: str) -> list[asyncio.Task]:
        settings, lifecycle = self.settings, self.lifecycle
        tasks = [asyncio.ensure_future(watch_loop_lag())]
        if settings.file_system_poll_wait_seconds > 0:
            tasks.append(asyncio.ensure_future(lifecycle.poll_files()))
        if settings.model_config_file and settings.model_config_file_poll_wait_seconds > 0:
            tasks.append(asyncio.ensure_future(lifecycle.poll_config(config_text)))
        if settings.model_repositories and settings.model_control_mode == "poll":
            tasks.append(asyncio.ensure_future(lifecycle.poll_repositories()))
        return tasks

    async def drain(self) -> None:
        log.info("draining: no new calls, in-flight calls have %.0fs to finish", self.settings.drain_seconds)
        await self.health.enter_graceful_shutdown()
        await self.ports.close(self.settings.drain_seconds)
        # queued runs finish; the loop stays responsive
        await asyncio.get_running_loop().run_in_executor(None, self.run_handler.close)
        await asyncio.get_running_loop().run_in_executor(None, tracing.TRACER.close)  # the last traces go out
        self.manager.unload_all()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()


async def serve(settings: ServerSettings) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        specs, config_text, refused = initial_specs(settings)
        batching = batching_options(settings)
    except (OSError, InvalidArgument) as e:
        log.error("cannot read the models to serve, nothing to serve: %s", e)
        return 1
    log.info("%s", start_line(settings, specs))
    try:
        process = Process(settings, loop, batching)
    except DeviceError as e:
        log.error("%s", e)
        return 1
    await process.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    # Alone, servex opens its ports first (health NOT_SERVING while the models load). One of several serving
    # processes opens them once its models are in: the kernel then never hands it a connection it cannot serve.
    in_group = settings.process_group_size > 1
    if not in_group and not await process.ports.open():
        await loop.run_in_executor(None, process.run_handler.close)
        return 1
    if not in_group:  # a group's /metrics adds up the processes' files: this process's statistics are not in them
        register_triton_names()
    if not await process.open_metrics():
        await process.ports.close(0)
        await loop.run_in_executor(None, process.run_handler.close)
        return 1
    tasks: list[asyncio.Task] = []
    pin: LoopPin | None = None
    exit_code = 0
    try:
        loaded = await process.load(specs, refused, stop)
        if loaded is False or (loaded and in_group and not await process.ports.open()):
            exit_code = 1
        elif loaded:
            tasks = process.background_tasks(config_text)
            log.info("froze %d start-up objects out of the garbage collector's scans", settle_heap())
            if settings.event_loop_cpu >= 0:
                pin = LoopPin(settings.event_loop_cpu)
                pin.pin()
            available = process.manager.available_models()
            log.info("servex ready on %s:%d, serving %s", settings.bind_address, settings.port,
                     ", ".join(available) or "no model yet")  # fmt: skip
            group.notify_ready()  # one of a group's serving processes: its supervisor counts it serving
            await stop.wait()
    except (OSError, InvalidArgument) as e:
        log.error("cannot load the models to serve, nothing to serve: %s", e)
        exit_code = 1
    for task in tasks:
        task.cancel()
    if pin is not None:
        pin.unpin()
    await process.drain()
    log.info("servex stopped")
    return exit_code


def run(settings: ServerSettings) -> int:
    return asyncio.run(serve(settings))
