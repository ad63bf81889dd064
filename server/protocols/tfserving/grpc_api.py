"""TensorFlow Serving's gRPC API (PredictionService, ModelService) over the ServingCore.

Thin: decode the request's protobufs into NumPy, call the core, encode the answer. Every ServingError becomes the
gRPC status it names, with its message; anything unexpected becomes INTERNAL and is logged. Predict, Classify,
Regress, MultiInference and SessionRun calls of a model with a logging_config are logged (``logged``,
server/protocols/tfserving/request_logging.py).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf import any_pb2
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    inference_pb2,
    model_management_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
    session_service_pb2,
)

from servex.loader.config import ModelSpec, specs_from_proto
from servex.loader.errors import CODE_NAMES, FailedPrecondition, InvalidArgument, NotFound
from servex.server.core import REQUEST, ServingCore
from servex.server.protocols.tfserving import examples
from servex.server.protocols.tfserving.request_logging import logged
from servex.server.transport import tensors
from servex.server.transport.rpc import rpc, spec_version

log = logging.getLogger(__name__)


def in_tfserving_words(error: NotFound) -> NotFound:
    """``error`` as TensorFlow Serving's APIs say it: an unknown model or version starts with TensorFlow Serving's
    words ("Servable not found for request: Latest(m)", GetModelStatus's "Could not find any versions of model
    m"), which its documentation shows and its users' scripts look for; the other protocols answer Triton's."""
    return NotFound(error.tfserving) if error.tfserving else error


def model_status_response(
    manager, name: str, version: int | None, label: str
) -> get_model_status_pb2.GetModelStatusResponse:
    """TensorFlow Serving's GetModelStatus answer (gRPC and REST): every known version of ``name``, highest first as
    TensorFlow Serving's ServableStateMonitor orders them (clients read the first as the newest), or the one asked
    for; each with its status, OK included. A model none of whose versions has been seen yet is NOT_FOUND, in
    TensorFlow Serving's words."""
    served = manager.statuses(name, version, label)
    if not served:
        raise NotFound(f"Could not find any versions of model {name}: none has been found under its base path yet")
    response = get_model_status_pb2.GetModelStatusResponse()
    for sv in reversed(served):
        status = response.model_version_status.add()
        status.version = sv.version
        status.state = get_model_status_pb2.ModelVersionStatus.State.Value(sv.state)
        status.status.SetInParent()
        if sv.error is not None:
            status.status.error_code = CODE_NAMES.index(sv.error.code)
            status.status.error_message = sv.error.message
    return response


def tfserving_errors(method):
    """A TensorFlow Serving gRPC method whose NotFound errors are said in TensorFlow Serving's words."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except NotFound as e:
            raise in_tfserving_words(e) from e

    return wrapper


class PredictionService(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, core: ServingCore, tensor_content_outputs: bool = False, max_tensor_bytes: int | None = None):
        self.core = core
        self.tensor_content_outputs = tensor_content_outputs
        self.max_tensor_bytes = max_tensor_bytes

    @rpc
    @tfserving_errors
    @logged("predict_log")
    async def Predict(self, request: predict_pb2.PredictRequest, context) -> predict_pb2.PredictResponse:
        spec = request.model_spec
        limit = self.max_tensor_bytes
        info, started = REQUEST.get(), time.perf_counter()
        inputs = await tensors.decode_all(
            request.inputs, limit, lambda: self.core.resolve(spec.name, spec_version(spec), spec.version_label)
        )
        info.compute_input = time.perf_counter() - started
        result = await self.core.predict(
            spec.name, spec_version(spec), spec.version_label, spec.signature_name, inputs, request.output_filter
        )
        started = time.perf_counter()
        response = predict_pb2.PredictResponse()
        response.model_spec.name = result.model_name
        response.model_spec.version.value = result.version
        response.model_spec.signature_name = result.signature_name
        info.answer_bytes = tensors.answer_bound(result.outputs.values())
        pairs = [(response.outputs[alias], value) for alias, value in result.outputs.items()]
        await tensors.fill_all(pairs, self.tensor_content_outputs)
        info.compute_output = time.perf_counter() - started
        return response

    @rpc
    @tfserving_errors
    @logged("classify_log")
    async def Classify(self, request: classification_pb2.ClassificationRequest, context):
        return await examples.classify(self.core, request)

    @rpc
    @tfserving_errors
    @logged("regress_log")
    async def Regress(self, request: regression_pb2.RegressionRequest, context):
        return await examples.regress(self.core, request)

    @rpc
    @tfserving_errors
    @logged("multi_inference_log")
    async def MultiInference(self, request: inference_pb2.MultiInferenceRequest, context):
        return await examples.multi_inference(self.core, request)

    @rpc
    @tfserving_errors
    async def GetModelMetadata(self, request: get_model_metadata_pb2.GetModelMetadataRequest, context):
        fields = list(request.metadata_field)
        if not fields:
            raise InvalidArgument("metadata_field is empty: ask for 'signature_def'")
        unsupported = [f for f in fields if f != "signature_def"]
        if unsupported:
            raise InvalidArgument(f"metadata_field {unsupported} is not supported; supported: ['signature_def']")
        spec = request.model_spec
        served = self.core.resolve(spec.name, spec_version(spec), spec.version_label)
        signature_map = get_model_metadata_pb2.SignatureDefMap()
        # Every SignatureDef of the MetaGraphDef, as TensorFlow Serving answers (TF2's __saved_model_init_op too,
        # which no request can run).
        for name, sig in served.servable.model.meta_graph.signature_def.items():
            signature_map.signature_def[name].CopyFrom(sig)
        packed = any_pb2.Any()
        packed.Pack(signature_map)
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        response.model_spec.name = served.name
        response.model_spec.version.value = served.version
        response.metadata["signature_def"].CopyFrom(packed)
        return response


class ModelService(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(
        self,
        core: ServingCore,
        reload_config: Callable[[list[ModelSpec]], Awaitable[list[str]]],
        process_group_size: int = 1,
    ):
        self.core = core
        self.reload_config = reload_config
        self.process_group_size = process_group_size

    @rpc
    @tfserving_errors
    async def GetModelStatus(self, request: get_model_status_pb2.GetModelStatusRequest, context):
        spec = request.model_spec
        if not spec.name:
            raise InvalidArgument("model_spec.name is empty: name the model to ask about")
        return model_status_response(self.core.manager, spec.name, spec_version(spec), spec.version_label)

    @rpc
    async def HandleReloadConfigRequest(self, request: model_management_pb2.ReloadConfigRequest, context):
        if self.process_group_size > 1:  # this call would reach one process of the group only
            raise FailedPrecondition(
                f"HandleReloadConfigRequest reaches one of {self.process_group_size} serving processes "
                f"(--serving_processes): change the models through --model_config_file, which every process re-reads "
                f"every --model_config_file_poll_wait_seconds"
            )
        specs = specs_from_proto(request.config, "ReloadConfigRequest.config", replacing=True)
        problems = await self.reload_config(specs)
        if problems:
            raise FailedPrecondition("the new config is in effect except: " + "; ".join(problems))
        return model_management_pb2.ReloadConfigResponse()


class SessionService:
    """TensorFlow Serving's SessionService (tensorflow-serving-api ships its messages but no gRPC stubs)."""

    SERVICE = "tensorflow.serving.SessionService"

    def __init__(self, core: ServingCore, tensor_content_outputs: bool = False, max_tensor_bytes: int | None = None):
        self.core = core
        self.tensor_content_outputs = tensor_content_outputs
        self.max_tensor_bytes = max_tensor_bytes

    @rpc
    @tfserving_errors
    @logged("session_run_log")
    async def SessionRun(self, request: session_service_pb2.SessionRunRequest, context):
        spec = request.model_spec
        protos = {}
        for named in request.feed:
            if named.name in protos:
                raise InvalidArgument(f"feed names {named.name!r} twice")
            protos[named.name] = named.tensor
        feeds = await tensors.decode_all(
            protos, self.max_tensor_bytes, lambda: self.core.resolve(spec.name, spec_version(spec), spec.version_label)
        )
        result = await self.core.run_graph(
            spec.name,
            spec_version(spec),
            spec.version_label,
            feeds,
            list(request.fetch),
            list(request.target),
            aliases_of=spec.signature_name if request.tensor_name_is_alias else None,
        )
        response = session_service_pb2.SessionRunResponse()
        response.model_spec.name = result.model_name
        response.model_spec.version.value = result.version
        response.model_spec.signature_name = spec.signature_name
        REQUEST.get().answer_bytes = tensors.answer_bound(result.outputs)
        pairs = []
        for name, value in zip(request.fetch, result.outputs, strict=True):
            named = response.tensor.add(name=name)
            pairs.append((named.tensor, value))
        await tensors.fill_all(pairs, self.tensor_content_outputs)
        return response

    def add_to_server(self, server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(
            self.SessionRun,
            request_deserializer=session_service_pb2.SessionRunRequest.FromString,
            response_serializer=session_service_pb2.SessionRunResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(self.SERVICE, {"SessionRun": handler}),))
        server.add_registered_method_handlers(self.SERVICE, {"SessionRun": handler})  # as generated code does
