"""The KServe v2 / Open Inference Protocol gRPC API (`inference.GRPCInferenceService`, what tritonclient.grpc
calls): an adapter over the KServe data plane (server/protocols/kserve/dataplane.py).

Thin: turn the message into the data plane's request (``InferParameter`` oneofs into plain values; tensors decoded
with server/protocols/kserve/v2_types.py: raw_input_contents, typed contents, shared memory), call the data plane,
encode its answer. What is gRPC's own stays here: raw_output_contents, ModelStreamInfer's streaming, and the ports.
`KServeService` serves the inference methods on the main port; `RepositoryService` serves the model repository
extension on the admin port (load: add the model to the served config; unload: take it out), with the read-only
ModelReady, ModelMetadata and ModelConfig that a client asks after a load, and the main port answers the repository
methods UNIMPLEMENTED (unless the data plane serves the extension there: explicit model control of a Triton model
repository).

Kept out of `server.app`'s module-level imports: the generated `inference.*` messages share their full names with
tritonclient's, and one process cannot hold both (the tests import tritonclient).
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from google.protobuf import json_format

from servex.loader.errors import InvalidArgument, ServingError, Unimplemented
from servex.protos.inference import grpc_service_pb2 as pb
from servex.protos.inference import grpc_service_pb2_grpc as pb_grpc
from servex.protos.inference import model_config_pb2
from servex.server.core import REQUEST, RequestInfo
from servex.server.protocols.kserve import v2_types
from servex.server.protocols.kserve.dataplane import (
    ADMIN_EXTENSIONS,
    DataPlane,
    repository_index,
    repository_load,
    repository_unload,
)
from servex.server.protocols.kserve.dataplane_rules import ModelMetadata
from servex.server.protocols.kserve.repository import ModelRepository
from servex.server.transport import tensors
from servex.server.transport.rpc import (
    Malformed,
    abort,
    bounded,
    check_answer_size,
    ended_code,
    model_name,
    record,
    request_info,
    rpc,
)

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
FINAL_RESPONSE = "triton_final_response"  # a stream answer's parameter: the request's last answer
# Requests of one ModelStreamInfer stream running at once; beyond, the stream's next request is read once the
# oldest one's answer is sent. As many as the callers a batch serves (max_batch_size's default).
STREAM_WINDOW = 32
GRPC_ERROR_METADATA = "triton_grpc_error"  # "true": a stream's first error ends it with its gRPC status


def metadata_response(answer: ModelMetadata) -> pb.ModelMetadataResponse:
    def tensor(t) -> pb.ModelMetadataResponse.TensorMetadata:
        return pb.ModelMetadataResponse.TensorMetadata(name=t.name, datatype=t.datatype, shape=t.shape)

    return pb.ModelMetadataResponse(
        name=answer.name,
        versions=answer.versions,
        platform=answer.platform,
        inputs=[tensor(t) for t in answer.inputs],
        outputs=[tensor(t) for t in answer.outputs],
    )


class _ServerCalls:
    """What a Triton client asks first, on either port: live, ready, and the extensions that port serves
    (``extensions``: None, the data plane's). Needs ``self.plane``."""

    extensions: tuple[str, ...] | None = None
    plane: DataPlane

    @rpc
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @rpc
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.plane.server_ready())

    @rpc
    async def ServerMetadata(self, request, context):
        meta = self.plane.server_metadata(self.extensions)
        return pb.ServerMetadataResponse(name=meta.name, version=meta.version, extensions=meta.extensions)


class _ModelCalls:
    """What a Triton client asks about a model, on either port: ready, metadata and config (read-only; on the admin
    port too, where a client that loads a model asks next whether it is ready). Needs ``self.plane``."""

    plane: DataPlane

    @rpc
    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self.plane.model_ready(request.name, request.version).ready)

    @rpc
    async def ModelMetadata(self, request, context):
        return metadata_response(self.plane.model_metadata(request.name, request.version))

    @rpc
    async def ModelConfig(self, request, context):
        config = self.plane.model_config(request.name, request.version)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))


class KServeService(_ServerCalls, _ModelCalls, pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: DataPlane, max_tensor_bytes: int | None = None):
        self.plane = plane
        self.core = plane.core
        self.max_tensor_bytes = max_tensor_bytes  # --max_message_bytes: no answer larger is sent

    @rpc
    async def ModelStatistics(self, request, context):
        stats = self.plane.model_statistics(request.name, request.version)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    @rpc
    async def ModelInfer(self, request, context):
        return await self._infer(request)

    async def _infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        plane = self.plane
        info = REQUEST.get()
        parameters, outputs = v2_types.infer_fields(request)
        call = plane.infer_request(request.model_name, request.model_version, request.id, parameters, outputs, info)
        started = time.perf_counter()
        shared = plane.shared_memory
        decode = v2_types.decode_infer_inputs
        # Raw fixed-size inputs are arrays over the request's bytes (cost 0); typed contents, BYTES and shared
        # memory are walked or copied: large ones decode off the event loop.
        tensors_in, raw_in = request.inputs, request.raw_input_contents
        cost = v2_types.decode_cost(tensors_in, len(raw_in))
        model = request.model_name
        if cost < tensors.OFF_LOOP_ELEMENTS:  # the hot path: no coroutine of off_loop's
            call.inputs, _ = decode(tensors_in, raw_in, shared, model)
        else:  # a large decode: a model that is not served is answered before anything is copied
            self.core.resolve(model, call.version)
            call.inputs, _ = await tensors.off_loop(cost, decode, tensors_in, raw_in, shared, model)
        info.compute_input = time.perf_counter() - started
        answer = await plane.infer(call)
        started = time.perf_counter()
        response = pb.ModelInferResponse(model_name=answer.model_name, model_version=answer.model_version)
        if answer.id:
            response.id = answer.id
        outputs, places = answer.outputs, call.places()
        info.answer_bytes = tensors.answer_bound(outputs.values())
        # Always in raw_output_contents, whatever the request sent, as Triton answers: clients (Triton's own
        # grpc_explicit_*_content examples) read raw_output_contents[i] even after sending typed contents.
        if not places and all(array.dtype.kind != "O" for array in outputs.values()):  # one copy each
            v2_types.fill_infer_outputs(response, outputs, True, shared, places)
        else:  # strings or shared memory writes: large ones encode off the event loop
            elements = sum(array.size for array in outputs.values())
            await tensors.off_loop(elements, v2_types.fill_infer_outputs, response, outputs, True, shared, places)
        info.compute_output = time.perf_counter() - started
        return response

    async def ModelStreamInfer(self, request_iterator, context):
        """Each request is answered in order, its answer marked final (``triton_final_response``, as Triton marks
        a model's last answer to a request: servex gives one per request). A failed one answers ``error_message``
        (the message alone, as Triton's) with the request's id and model, and the stream goes on; with Triton's
        ``triton_grpc_error: true`` metadata the error ends the stream with its gRPC status instead.

        Requests run as they arrive, up to STREAM_WINDOW of one stream at once (so they queue, and batch, as
        separate calls do), while their answers go back in request order."""
        grpc_errors = any(key == GRPC_ERROR_METADATA and str(value).lower() == "true"
                          for key, value in context.invocation_metadata() or ())  # fmt: skip
        window = asyncio.Semaphore(STREAM_WINDOW)
        started: asyncio.Queue = asyncio.Queue()  # the requests' tasks in arrival order, then None
        ended: list[BaseException] = []  # what ended the reading of requests, if not their end

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await window.acquire()
                    started.put_nowait(asyncio.ensure_future(self._stream_one(request, context)))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # the stream broke: answer what came, then end as it ended
                ended.append(e)
            finally:
                started.put_nowait(None)  # whatever ended the reading (the queue is unbounded)

        reader = asyncio.ensure_future(read())
        try:
            while (task := await started.get()) is not None:
                request, answer, error = await task
                window.release()
                if error is not None:
                    if grpc_errors:
                        await abort(context, getattr(grpc.StatusCode, error.code), bounded(error.message))
                    answer = pb.ModelStreamInferResponse(error_message=error.message)  # as Triton: the message alone
                    if type(request) is not Malformed:  # which request failed
                        failed = answer.infer_response
                        failed.id, failed.model_name, failed.model_version = (
                            request.id, request.model_name, request.model_version)  # fmt: skip
                    answer.infer_response.parameters[FINAL_RESPONSE].bool_param = True
                yield answer
            if ended:
                raise ended[0]
        finally:
            reader.cancel()
            while not started.empty():
                task = started.get_nowait()
                if task is not None:
                    task.cancel()

    async def _stream_one(self, request, context) -> tuple:
        """One request of a stream: (the request, its answer or None, its ServingError or None)."""
        start = time.perf_counter()
        code = "OK"
        info = RequestInfo()
        deadline = None
        error = answer = None
        try:
            if type(request) is Malformed:
                raise request.error(request.message)
            info = request_info(context)
            deadline = info.deadline  # the stream's own (a request parameter may shorten info's for the queue)
            REQUEST.set(info)  # this task's own context: each request has its own
            answer = pb.ModelStreamInferResponse(infer_response=await self._infer(request))
            answer.infer_response.parameters[FINAL_RESPONSE].bool_param = True  # before the size check
            limit = self.max_tensor_bytes
            if limit is not None and (info.answer_bytes is None or info.answer_bytes > limit):
                check_answer_size(answer, limit, "ModelStreamInfer")
        except ServingError as e:
            code, error = e.code, e
        except asyncio.CancelledError:  # gRPC ended the stream: its deadline passed, or the client cancelled
            code = ended_code(deadline)
            raise
        except Exception as e:  # one bad request must not end the stream
            code = "INTERNAL"
            log.exception("ModelStreamInfer failed")
            error = ServingError(f"{type(e).__name__}: {e}")
        finally:
            record(self.core, "ModelStreamInfer", model_name(request), info, code, start)
        return request, answer, error

    ModelStreamInfer.parses_malformed = True

    # -- Triton's system shared memory extension (server/protocols/kserve/shared_memory.py)---------------------------

    @rpc
    async def SystemSharedMemoryStatus(self, request, context):
        answer = pb.SystemSharedMemoryStatusResponse()
        for region in self.plane.shared_memory_status(request.name):
            answer.regions[region["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return answer

    @rpc
    async def SystemSharedMemoryRegister(self, request, context):
        self.plane.register_shared_memory(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @rpc
    async def SystemSharedMemoryUnregister(self, request, context):
        self.plane.unregister_shared_memory(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @rpc
    async def CudaSharedMemoryStatus(self, request, context):
        self.plane.cuda_shared_memory_status(request.name)  # empty, or NOT_FOUND for a named region
        return pb.CudaSharedMemoryStatusResponse()

    @rpc
    async def CudaSharedMemoryRegister(self, request, context):
        self.plane.register_cuda_shared_memory()
        return pb.CudaSharedMemoryRegisterResponse()

    @rpc
    async def CudaSharedMemoryUnregister(self, request, context):
        self.plane.unregister_cuda_shared_memory(request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    @rpc
    async def LogSettings(self, request, context):
        changes = {}
        for key, value in request.settings.items():
            choice = value.WhichOneof("parameter_choice")
            if choice is None:
                raise InvalidArgument(f"log setting {key!r} has no value: set bool_param, uint32_param or string_param")
            changes[key] = getattr(value, choice)
        response = pb.LogSettingsResponse()
        for key, value in self.plane.update_log_settings(changes).items():
            field = {bool: "bool_param", int: "uint32_param", str: "string_param"}[type(value)]
            setattr(response.settings[key], field, value)
        return response

    @rpc
    async def TraceSetting(self, request, context):
        changes = {key: list(value.value) for key, value in request.settings.items()}
        response = pb.TraceSettingResponse()
        for key, values in self.plane.trace_settings(request.model_name, changes).items():
            response.settings[key].value.extend(values)
        return response

    # The repository extension lives on the admin port (unless a Triton repository's explicit model control puts it
    # here too); else this says where to find it.
    def _repository(self, method: str, context) -> ModelRepository:
        repository = self.plane.repository
        if repository is None:
            raise _admin_only(method)
        repository.check_access("grpc", context.invocation_metadata() or ())
        return repository

    @rpc
    async def RepositoryIndex(self, request, context):
        return await index_response(self._repository("RepositoryIndex", context), request)

    @rpc
    async def RepositoryModelLoad(self, request, context):
        return await load_response(self._repository("RepositoryModelLoad", context), request)

    @rpc
    async def RepositoryModelUnload(self, request, context):
        return await unload_response(self._repository("RepositoryModelUnload", context), request)


def _admin_only(method: str) -> Unimplemented:
    return Unimplemented(f"{method} (the model repository extension) is served on the admin port (--admin_port)")


class RepositoryService(_ServerCalls, _ModelCalls, pb_grpc.GRPCInferenceServiceServicer):
    """The model repository extension (server/protocols/kserve/repository.py) over gRPC on the admin port, with the
    read-only calls a client makes after a load."""

    extensions = ADMIN_EXTENSIONS

    def __init__(self, plane: DataPlane, repository: ModelRepository):
        self.plane = plane
        self.core = plane.core
        self.repository = repository

    async def ModelStreamInfer(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, _main_port_only("ModelStreamInfer").message)

    @rpc
    async def RepositoryIndex(self, request, context):
        return await index_response(self.repository, request)

    @rpc
    async def RepositoryModelLoad(self, request, context):
        return await load_response(self.repository, request)

    @rpc
    async def RepositoryModelUnload(self, request, context):
        return await unload_response(self.repository, request)


async def index_response(repository: ModelRepository, request) -> pb.RepositoryIndexResponse:
    response = pb.RepositoryIndexResponse()
    for entry in await repository_index(repository, request.repository_name, request.ready):
        response.models.add(**entry)
    return response


async def load_response(repository: ModelRepository, request) -> pb.RepositoryModelLoadResponse:
    parameters = v2_types.parameter_values(request.parameters)
    await repository_load(repository, request.repository_name, request.model_name, parameters)
    return pb.RepositoryModelLoadResponse()


async def unload_response(repository: ModelRepository, request) -> pb.RepositoryModelUnloadResponse:
    await repository_unload(repository, request.repository_name, request.model_name)
    return pb.RepositoryModelUnloadResponse()


def _main_port_only(method: str) -> Unimplemented:
    return Unimplemented(f"{method} is served on the main gRPC port (--port); the admin port serves the model "
                         f"repository extension")  # fmt: skip


def _refuse_on_the_admin_port(method: str):
    async def refuse(self, request, context):
        raise _main_port_only(method)

    refuse.__name__ = refuse.__qualname__ = method  # before rpc() reads it: the metrics' method label
    return rpc(refuse)


# Every other unary method of the service answers UNIMPLEMENTED naming the main port (grpcio's servicer base class
# would raise NotImplementedError: UNKNOWN, and a traceback logged per call).
for _method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
    unserved = getattr(RepositoryService, _method.name) is getattr(pb_grpc.GRPCInferenceServiceServicer, _method.name)
    if unserved and not _method.client_streaming:
        setattr(RepositoryService, _method.name, _refuse_on_the_admin_port(_method.name))


def add_to_server(plane: DataPlane, server, max_tensor_bytes: int | None = None) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(KServeService(plane, max_tensor_bytes), server)


def add_repository_to_server(plane: DataPlane, repository: ModelRepository, server) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(RepositoryService(plane, repository), server)
