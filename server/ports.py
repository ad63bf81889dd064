"""The ports of one serving process: gRPC (TensorFlow Serving's APIs, KServe v2, servex.v1, health, reflection,
TensorFlow's profiler: ``add_grpc_services``), the admin port, and REST; opened together and closed together
(``Ports``). A port that cannot be bound is logged naming its flag."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tensorflow_serving.apis import (
    model_service_pb2,
    model_service_pb2_grpc,
    prediction_service_pb2,
    prediction_service_pb2_grpc,
)

from servex.protos.servex.v1 import graph_executor_pb2, graph_executor_pb2_grpc, variables_pb2_grpc
from servex.server.config.settings import ServerSettings
from servex.server.core import ServingCore
from servex.server.lifecycle import Lifecycle
from servex.server.observability import profiler
from servex.server.protocols.kserve.dataplane import DataPlane
from servex.server.protocols.kserve.repository import ModelRepository
from servex.server.protocols.servex.admin import BearerTokenInterceptor, VariableService
from servex.server.protocols.servex.graph_service import GraphExecutorService
from servex.server.protocols.tfserving.grpc_api import ModelService, PredictionService, SessionService
from servex.server.transport import tls
from servex.server.transport.http import RestServer
from servex.server.transport.listeners import ListenerGroup, refuse_if_served

log = logging.getLogger("servex")

# The ports servex binds, by flag: what port_clash names when another flag of the same process holds the port.
PORT_FLAGS = {"--port": "port", "--rest_api_port": "rest_api_port", "--metrics_port": "metrics_port",
              "--admin_port": "admin_port"}  # fmt: skip


def port_clash(flag: str, what: str, address: str, port: int, error: BaseException, settings=None) -> str:
    """Why ``flag``'s port could not be bound, naming the flag, and what to do."""
    text = f"cannot bind {what} to {address}:{port} ({flag}): {error}"
    in_use = isinstance(error, OSError) and error.errno == errno.EADDRINUSE or "in use" in str(error).lower()
    if not in_use:
        return text
    return (f"{text}. Another process holds port {port}: if it is another servex, give this one its own {flag} "
            f"(each of --port, --rest_api_port, --metrics_port and --admin_port must be free; 0 turns REST, "
            f"metrics and admin off)")  # fmt: skip


def _in_use(host: str, port: int) -> OSError | None:
    """The error binding ``host:port`` gives when another socket holds it (EADDRINUSE), else None."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError as e:
            return e if e.errno == errno.EADDRINUSE else None
    return None


def grpc_options(settings: ServerSettings) -> list[tuple[str, object]]:
    options = {
        "grpc.max_receive_message_length": settings.max_message_bytes,
        "grpc.max_send_message_length": settings.max_message_bytes,
        "grpc.so_reuseport": 0,  # the admin port; the listeners set their own
    }
    return list({**options, **dict(settings.grpc_channel_arguments)}.items())  # the user's win


def add_grpc_services(server, settings: ServerSettings, core: ServingCore, plane: DataPlane, lifecycle: Lifecycle,
                      health_servicer) -> None:  # fmt: skip
    """Every service of the main gRPC port: TensorFlow Serving's, KServe v2's, servex.v1's, health, reflection, and
    with --enable_profiler TensorFlow's profiler (tensorflow.ProfilerService: TensorBoard's "Capture profile")."""
    from servex.server.protocols.kserve import (
        grpc_api as kserve,  # not at module level: its inference.* protos clash with tritonclient's in one process
    )

    limit = settings.max_message_bytes
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionService(core, settings.tensor_content_outputs, limit), server
    )
    SessionService(core, settings.tensor_content_outputs, limit).add_to_server(server)
    graph_executor_pb2_grpc.add_GraphExecutorServicer_to_server(GraphExecutorService(core, limit), server)
    kserve.add_to_server(plane, server, limit)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(
        ModelService(core, lifecycle.apply, settings.process_group_size), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if settings.enable_profiler:
        profiler.add_to_server(server)
    names = [
        prediction_service_pb2.DESCRIPTOR.services_by_name["PredictionService"].full_name,
        model_service_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
        SessionService.SERVICE,
        graph_executor_pb2.DESCRIPTOR.services_by_name["GraphExecutor"].full_name,
        kserve.SERVICE,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
        *([profiler.SERVICE] if settings.enable_profiler else []),
    ]
    reflection.enable_server_reflection(names, server)


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
        bound, error = 0, e
    else:
        error = RuntimeError("gRPC could not bind it")
    if bound == 0:  # some grpcio versions say only "Failed to bind": whether the port is taken is asked here
        host, port = settings.admin_bind_address, settings.admin_port
        raise OSError(port_clash("--admin_port", "the admin port", host, port, _in_use(host, port) or error))
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


class Ports:
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
            log.error("%s", port_clash("--port", "gRPC", settings.bind_address, settings.port, e))
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
                body_timeout_s=settings.rest_api_body_timeout_in_ms / 1000,
                cors=settings.rest_api_enable_cors_support,
                batching=settings.enable_batching,
                routes=(functools.partial(kserve_rest.add_routes, plane=self.plane), tfserving_rest.add_routes),
            )
            try:
                await self.rest.start()
            except OSError as e:
                log.error("%s", port_clash("--rest_api_port", "REST", settings.bind_address, settings.rest_api_port, e))
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
