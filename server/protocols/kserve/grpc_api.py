"""The KServe v2 / Open Inference Protocol gRPC API (`inference.GRPCInferenceService`, what tritonclient.grpc
calls) over the ServingCore.

Thin: decode the request with `server/protocols/kserve/v2_types.py`, call the core, encode the answer. A v2 model is a
servex
model; its tensors are the `serving_default` signature's input and output aliases. Triton's ModelConfig and
ModelStatistics are answered from what is served (server/protocols/kserve/v2_config.py,
server/protocols/kserve/v2_stats.py). `KServeService` serves the
inference methods on the main port; `RepositoryService` serves the model repository extension on the admin port
(load: add the model to the served config; unload: take it out), with the read-only ModelReady, ModelMetadata and
ModelConfig that a client asks after a load, and the main port answers the repository methods UNIMPLEMENTED.

Kept out of `server.app`'s module-level imports: the generated `inference.*` messages share their full names with
tritonclient's, and one process cannot hold both (the tests import tritonclient).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from importlib import metadata

import grpc
from google.protobuf import json_format

from servex.loader.errors import InvalidArgument, ServingError, Unimplemented
from servex.loader.manager import AVAILABLE
from servex.protos.inference import grpc_service_pb2 as pb
from servex.protos.inference import grpc_service_pb2_grpc as pb_grpc
from servex.protos.inference import model_config_pb2
from servex.server.core import DEFAULT_SIGNATURE, REQUEST, RequestInfo, ServingCore, checked_priority
from servex.server.protocols.kserve import v2_config, v2_settings, v2_stats, v2_types
from servex.server.protocols.kserve.repository import BASE_PATH, ModelRepository
from servex.server.protocols.kserve.shared_memory import NO_CUDA_MEMORY
from servex.server.protocols.kserve.v2_config import PLATFORM
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
# What ServerMetadata lists on the admin port: the model repository extension, the one it serves (the main port's:
# v2_types.EXTENSIONS).
ADMIN_EXTENSIONS = ("model_repository",)
PRIORITY = "priority"
TIMEOUT = "timeout"
FINAL_RESPONSE = "triton_final_response"  # a stream answer's parameter: the request's last answer
# Requests of one ModelStreamInfer stream running at once; beyond, the stream's next request is read once the
# oldest one's answer is sent. As many as the callers a batch serves (max_batch_size's default).
STREAM_WINDOW = 32
GRPC_ERROR_METADATA = "triton_grpc_error"  # "true": a stream's first error ends it with its gRPC status


@functools.cache
def _server_version() -> str:
    try:
        return metadata.version("servex")
    except metadata.PackageNotFoundError:
        return "unknown"


def _tensor_metadata(name: str, spec) -> pb.ModelMetadataResponse.TensorMetadata:
    try:
        datatype = v2_types.datatype(spec.dtype)
    except ValueError:  # e.g. complex: no v2 datatype; say what it is
        datatype = spec.describe().split()[0]
    shape = [-1] if spec.shape is None else [-1 if d is None else d for d in spec.shape]
    return pb.ModelMetadataResponse.TensorMetadata(name=name, datatype=datatype, shape=shape)


class _ServerCalls:
    """What a Triton client asks first, on either port: live, ready, and the extensions that port serves
    (``extensions``). Needs ``self.core``."""

    extensions: tuple[str, ...] = ()

    @rpc
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @rpc
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.core.ready())

    @rpc
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="servex", version=_server_version(), extensions=self.extensions)


class _ModelCalls:
    """What a Triton client asks about a model, on either port: ready, metadata and config (read-only; on the admin
    port too, where a client that loads a model asks next whether it is ready). Needs ``self.core``."""

    @rpc
    async def ModelReady(self, request, context):
        version = v2_types.parse_version(request.version)
        if not request.name:  # no such model: not ready, as Triton answers it
            return pb.ModelReadyResponse(ready=False)
        try:
            self.core.resolve(request.name, version)
        except ServingError:  # unknown, loading, failed: not ready
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    @rpc
    async def ModelMetadata(self, request, context):
        version = v2_types.parse_version(request.version)
        if not request.name:
            raise InvalidArgument("name is empty: name the model to ask about")
        served = self.core.resolve(request.name, version)
        # A model without serving_default serves all the same (ModelReady says so): no inputs or outputs to list.
        sig = served.servable.model.signatures.get(DEFAULT_SIGNATURE)
        available = [sv.version for sv in self.core.manager.statuses(served.name) if sv.state == AVAILABLE]
        return pb.ModelMetadataResponse(
            name=served.name,
            versions=[str(v) for v in available],
            platform=PLATFORM,
            inputs=[_tensor_metadata(alias, spec) for alias, spec in sorted(sig.inputs.items())] if sig else [],
            outputs=[_tensor_metadata(alias, sig.outputs[alias]) for alias in sig.output_aliases] if sig else [],
        )

    @rpc
    async def ModelConfig(self, request, context):
        if not request.name:
            raise InvalidArgument("name is empty: name the model to ask about")
        config = v2_config.model_config(self.core, request.name, v2_types.parse_version(request.version))
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))


class KServeService(_ServerCalls, _ModelCalls, pb_grpc.GRPCInferenceServiceServicer):
    extensions = v2_types.EXTENSIONS

    def __init__(
        self, core: ServingCore, max_tensor_bytes: int | None = None, repository: ModelRepository | None = None
    ):
        self.core = core
        self.max_tensor_bytes = max_tensor_bytes  # --max_message_bytes: no answer larger is sent
        # The model repository extension, here only in explicit model control of a Triton model repository (as
        # Triton serves it); else on the admin port.
        self.repository = repository
        if repository is not None:
            self.extensions = (*v2_types.EXTENSIONS, *ADMIN_EXTENSIONS)

    @rpc
    async def ModelStatistics(self, request, context):
        stats = v2_stats.model_statistics(self.core, request.name, v2_types.parse_version(request.version))
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    @rpc
    async def ModelInfer(self, request, context):
        return await self._infer(request)

    async def _infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        version = v2_types.parse_version(request.model_version)
        if not request.model_name:
            raise InvalidArgument("model_name is empty: name the model to call")
        info = REQUEST.get()
        params = request.parameters
        if params:  # none, usually
            if PRIORITY in params:  # wins over x-servex-priority metadata
                info.priority = checked_priority(v2_types.priority_parameter(params[PRIORITY]), "parameter 'priority'")
            if TIMEOUT in params:  # microseconds the request may wait to run (Triton's); 0: none
                micros = v2_types.integer_parameter(params[TIMEOUT], TIMEOUT, "microseconds")
                if micros > 0:  # shortens the call's own deadline, never lengthens it
                    deadline = time.monotonic() + micros / 1e6
                    info.deadline = deadline if info.deadline is None else min(info.deadline, deadline)
        started = time.perf_counter()
        shared = self.core.shared_memory
        decode = v2_types.decode_infer_inputs
        # Raw fixed-size inputs are arrays over the request's bytes (cost 0); typed contents, BYTES and shared
        # memory are walked or copied: large ones decode off the event loop.
        tensors_in, raw_in = request.inputs, request.raw_input_contents
        cost = v2_types.decode_cost(tensors_in, len(raw_in))
        model = request.model_name
        if cost < tensors.OFF_LOOP_ELEMENTS:  # the hot path: no coroutine of off_loop's
            inputs, _ = decode(tensors_in, raw_in, shared, model)
        else:  # a large decode: a model that is not served is answered before anything is copied
            self.core.resolve(model, version)
            inputs, _ = await tensors.off_loop(cost, decode, tensors_in, raw_in, shared, model)
        info.compute_input = time.perf_counter() - started
        requested, classes, places = [], {}, {}
        for out in request.outputs:
            if v2_types.SHARED_MEMORY_REGION in out.parameters:
                places[out.name] = v2_types.shared_memory_place(out.parameters, f"output {out.name!r}")
            if v2_types.CLASSIFICATION in out.parameters:
                count = v2_types.integer_parameter(out.parameters[v2_types.CLASSIFICATION], "classification", "top N")
                classes[out.name] = v2_types.classification_count(count, out.name)
            requested.append(out.name)
        result = await self.core.predict(request.model_name, version, "", "", inputs, requested, "outputs")
        started = time.perf_counter()
        response = pb.ModelInferResponse(model_name=result.model_name, model_version=str(result.version))
        if request.id:
            response.id = request.id
        outputs = v2_types.classified(result.outputs, classes)
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
                raise InvalidArgument(request.message)
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
        for region in self.core.shared_memory.status(request.name):
            answer.regions[region["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return answer

    @rpc
    async def SystemSharedMemoryRegister(self, request, context):
        self.core.shared_memory.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @rpc
    async def SystemSharedMemoryUnregister(self, request, context):
        self.core.shared_memory.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    # CUDA shared memory: registering is UNIMPLEMENTED, so there is never a region to list or unregister; status and
    # unregister answer as a Triton without GPUs does (Triton's examples unregister all CUDA regions first).
    @rpc
    async def CudaSharedMemoryStatus(self, request, context):
        self.core.shared_memory.cuda_status(request.name)  # empty, or NOT_FOUND for a named region
        return pb.CudaSharedMemoryStatusResponse()

    @rpc
    async def CudaSharedMemoryRegister(self, request, context):
        raise _no_cuda_memory()

    @rpc
    async def CudaSharedMemoryUnregister(self, request, context):
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
        for key, value in self.core.log_settings.update(changes).items():
            field = {bool: "bool_param", int: "uint32_param", str: "string_param"}[type(value)]
            setattr(response.settings[key], field, value)
        return response

    @rpc
    async def TraceSetting(self, request, context):
        changes = {key: list(value.value) for key, value in request.settings.items()}
        response = pb.TraceSettingResponse()
        for key, values in v2_settings.trace_settings(self.core, request.model_name, changes).items():
            response.settings[key].value.extend(values)
        return response

    # The repository extension lives on the admin port (unless a Triton repository's explicit model control puts it
    # here too); else this says where to find it.
    @rpc
    async def RepositoryIndex(self, request, context):
        if self.repository is None:
            raise _admin_only("RepositoryIndex")
        self.repository.check_access("grpc", context.invocation_metadata() or ())
        return await repository_index(self.repository, request)

    @rpc
    async def RepositoryModelLoad(self, request, context):
        if self.repository is None:
            raise _admin_only("RepositoryModelLoad")
        self.repository.check_access("grpc", context.invocation_metadata() or ())
        return await repository_load(self.repository, request)

    @rpc
    async def RepositoryModelUnload(self, request, context):
        if self.repository is None:
            raise _admin_only("RepositoryModelUnload")
        self.repository.check_access("grpc", context.invocation_metadata() or ())
        return await repository_unload(self.repository, request)


def _no_cuda_memory() -> Unimplemented:
    return Unimplemented(NO_CUDA_MEMORY)


def _admin_only(method: str) -> Unimplemented:
    return Unimplemented(f"{method} (the model repository extension) is served on the admin port (--admin_port)")


class RepositoryService(_ServerCalls, _ModelCalls, pb_grpc.GRPCInferenceServiceServicer):
    """The model repository extension (server/protocols/kserve/repository.py) over gRPC on the admin port, with the
    read-only
    calls a client makes after a load."""

    extensions = ADMIN_EXTENSIONS

    def __init__(self, core: ServingCore, repository: ModelRepository):
        self.core = core
        self.repository = repository

    async def ModelStreamInfer(self, request_iterator, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, _main_port_only("ModelStreamInfer").message)

    @rpc
    async def RepositoryIndex(self, request, context):
        return await repository_index(self.repository, request)

    @rpc
    async def RepositoryModelLoad(self, request, context):
        return await repository_load(self.repository, request)

    @rpc
    async def RepositoryModelUnload(self, request, context):
        return await repository_unload(self.repository, request)


async def repository_index(repository: ModelRepository, request) -> pb.RepositoryIndexResponse:
    repository.check_name(request.repository_name)
    response = pb.RepositoryIndexResponse()
    for entry in await repository.index(request.ready):
        response.models.add(**entry)
    return response


async def repository_load(repository: ModelRepository, request) -> pb.RepositoryModelLoadResponse:
    repository.check_name(request.repository_name)
    name = request.model_name
    repository.check(name, "load")
    repository.check_parameters(name, request.parameters)
    base_path = None
    if BASE_PATH in request.parameters:
        param = request.parameters[BASE_PATH]
        if param.WhichOneof("parameter_choice") != "string_param" or not param.string_param:
            raise InvalidArgument(f"failed to load {name!r}: parameter {BASE_PATH!r} must be a string_param naming a "
                                  f"folder")  # fmt: skip
        base_path = param.string_param
    await repository.load(name, base_path)
    return pb.RepositoryModelLoadResponse()


async def repository_unload(repository: ModelRepository, request) -> pb.RepositoryModelUnloadResponse:
    repository.check_name(request.repository_name)
    await repository.unload(request.model_name)
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


def add_to_server(
    core: ServingCore, server, max_tensor_bytes: int | None = None, repository: ModelRepository | None = None
) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(KServeService(core, max_tensor_bytes, repository), server)


def add_repository_to_server(core: ServingCore, repository: ModelRepository, server) -> None:
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(RepositoryService(core, repository), server)
