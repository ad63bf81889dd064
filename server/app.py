"""The servex process: load the model, serve gRPC (TensorFlow Serving API, health, reflection) and /metrics,
drain on SIGTERM/SIGINT.

Start-up order: the gRPC port opens first with health NOT_SERVING, the model loads off the event loop, then
health turns SERVING. Shutdown: health NOT_SERVING, no new calls, in-flight calls finish (up to
``drain_seconds``), workers stop, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal

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

from executor import GraphExecutor, RunHandler
from loader import LoadError, ModelManager, load_saved_model
from server.core import ServingCore
from server.metrics import start_metrics_server
from server.settings import ServerSettings
from server.tfserving import ModelService, PredictionService
from transfer import make_factory

log = logging.getLogger("servex")


def make_manager(settings: ServerSettings) -> ModelManager[GraphExecutor]:
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=settings.tensorflow_intra_op_parallelism,
        inter_op_parallelism_threads=settings.tensorflow_inter_op_parallelism,
        allow_soft_placement=True,
    )
    transfer = make_factory(settings.device)

    def make(name: str, version: int, path: str) -> GraphExecutor:
        model = load_saved_model(path, session_config=config)
        return GraphExecutor(model, transfer=transfer, run_in_caller_thread=settings.run_in_caller_thread)

    return ModelManager(make, GraphExecutor.close)


async def serve(settings: ServerSettings) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    options = [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    manager = make_manager(settings)
    run_handler = RunHandler(settings.num_run_workers)
    core = ServingCore(manager, run_handler)
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
        PredictionService(core, settings.tensor_content_outputs, settings.max_message_bytes), server
    )
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [
            prediction_service_pb2.DESCRIPTOR.services_by_name["PredictionService"].full_name,
            model_service_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    address = f"{settings.bind_address}:{settings.port}"
    if server.add_insecure_port(address) == 0:
        log.error("cannot bind gRPC to %s", address)
        return 1
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    log.info("gRPC on %s", address)
    metrics_server = None
    if settings.metrics_port:
        metrics_server = start_metrics_server(settings.metrics_port, settings.bind_address)
    if settings.rest_api_port:
        log.info("--rest_api_port=%d: the REST API is not served yet", settings.rest_api_port)

    name, base_path = settings.model_name, settings.resolved_model_base_path()
    try:
        load = loop.run_in_executor(None, manager.load_latest, name, base_path)
        done, _ = await asyncio.wait([load, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if load in done:
            served = load.result()
            await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info("servex ready: model %r version %d on %s", name, served.version, address)
            await stop.wait()
        exit_code = 0
    except LoadError as e:
        log.error("model %r did not load, nothing to serve: %s", name, e.message)
        exit_code = 1
    except Exception:
        log.exception("model %r did not load, nothing to serve", name)
        exit_code = 1

    log.info("draining: no new calls, in-flight calls have %.0fs to finish", settings.drain_seconds)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(settings.drain_seconds)
    run_handler.close()
    manager.unload_all()
    if metrics_server is not None:
        metrics_server.shutdown()
    log.info("servex stopped")
    return exit_code


def run(settings: ServerSettings) -> int:
    return asyncio.run(serve(settings))
