"""KServe v2 (Open Inference Protocol) REST over the ServingCore, as tritonclient.http speaks it.

- ``GET /v2``: server metadata; ``GET /v2/health/live`` (200 while the process runs), ``GET /v2/health/ready``
  (200 while a model is available and the server is not draining, else 400), answering KServe's
  ``{"live": true}`` / ``{"ready": true}`` (Triton's bodies are empty; its clients read the status only).
- ``GET /v2/models/{name}[/versions/{v}]``: model metadata (the ``serving_default`` signature's inputs and
  outputs, v2 datatypes, -1 for unknown dimensions; none for a model without that signature); ``.../ready``: 200
  (``{"name": ..., "ready": true}``) when that version serves, else 4xx; ``.../config``: the model's
  configuration in Triton's form (server/protocols/kserve/v2_config.py); ``.../stats`` and ``GET /v2/models/stats``:
  inference
  statistics as Triton counts them (server/protocols/kserve/v2_stats.py).
- ``POST .../infer``: JSON tensors ``{"name", "shape", "datatype", "data"}`` (data flat or nested; a null
  ``id``, ``parameters`` or ``outputs`` is taken as absent, as KServe writes them) and the binary
  tensor extension: with header ``Inference-Header-Content-Length: N`` the first N bytes are the JSON and the
  rest the inputs' raw bytes, each input taking ``parameters.binary_data_size`` of them in order (fixed-size
  inputs become arrays over the body, no copy). Outputs come as JSON, or raw after the JSON when asked with
  ``outputs[].parameters.binary_data`` or the request parameter ``binary_data_output`` (tritonclient sets it when
  it names no outputs); the answer then carries ``Inference-Header-Content-Length``.
- Request parameters: ``priority`` (integer, larger runs first: servex's priority, as gRPC metadata
  ``x-servex-priority``), ``timeout`` (microseconds: the run must start within it, else 504),
  ``signature_name`` (servex's extension: the signature to run, default ``serving_default``).

Every ``GET`` endpoint answers ``HEAD`` too; another method on an endpoint's path is 405 with ``Allow``. Errors are
``{"error": "..."}`` with the status of server/transport/http.py's mapping.
"""

from __future__ import annotations

import time
import weakref
from importlib import metadata
from typing import Any

import numpy as np
from aiohttp import web

from servex.loader.errors import FailedPrecondition, InvalidArgument, NotFound, ServingError, Unimplemented
from servex.server.core import DEFAULT_SIGNATURE, RequestInfo, checked_priority
from servex.server.protocols.kserve import v2_config, v2_settings, v2_stats, v2_types
from servex.server.protocols.kserve.repository import BASE_PATH
from servex.server.protocols.kserve.shared_memory import NO_CUDA_MEMORY
from servex.server.protocols.kserve.v2_config import PLATFORM
from servex.server.transport import json_codec as codec
from servex.server.transport.http import (
    Call,
    HttpError,
    Rest,
    accepts_compression,
    json_response,
    offload,
    payload_bytes,
)

HEADER_LENGTH = "Inference-Header-Content-Length"
_INT64_MAX = 2**63 - 1


def add_routes(app: web.Application, rest: Rest) -> None:
    def route(method: str, path: str, name: str, handler, bounded: bool = True) -> None:
        endpoint = rest.endpoint(name, lambda r, c, i: handler(rest, r, c, i), bounded)
        app.router.add_route(method, path, endpoint)
        if method == "GET":  # HEAD as GET (probes and load balancers use it); aiohttp sends no body
            app.router.add_route("HEAD", path, endpoint)

    route("GET", "/v2", "rest:v2_server_metadata", server_metadata)
    route("GET", "/v2/health/live", "rest:v2_server_live", live)
    route("GET", "/v2/health/ready", "rest:v2_server_ready", ready)
    route("GET", "/v2/models/stats", "rest:v2_model_statistics", model_statistics)  # before /v2/models/{name}
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        route("GET", base, "rest:v2_model_metadata", model_metadata)
        route("GET", base + "/ready", "rest:v2_model_ready", model_ready)
        route("GET", base + "/config", "rest:v2_model_config", model_config)
        route("GET", base + "/stats", "rest:v2_model_statistics", model_statistics)
        route("POST", base + "/infer", "rest:v2_infer", infer)
    for base in ("/v2/systemsharedmemory", "/v2/systemsharedmemory/region/{region}"):
        route("GET", base + "/status", "rest:v2_shared_memory_status", shared_memory_status)
        route("POST", base + "/unregister", "rest:v2_shared_memory_unregister", shared_memory_unregister)
    route("POST", "/v2/systemsharedmemory/region/{region}/register", "rest:v2_shared_memory_register",
          shared_memory_register)  # fmt: skip
    for base in ("/v2/cudasharedmemory", "/v2/cudasharedmemory/region/{region}"):  # before the catch-all below
        route("GET", base + "/status", "rest:v2_cuda_shared_memory", cuda_shared_memory_status)
        route("POST", base + "/unregister", "rest:v2_cuda_shared_memory", cuda_shared_memory_unregister)
    route("*", "/v2/cudasharedmemory{tail:.*}", "rest:v2_cuda_shared_memory", cuda_shared_memory)
    route("GET", "/v2/logging", "rest:v2_logging", logging_settings)
    route("POST", "/v2/logging", "rest:v2_logging", logging_settings)
    for base in ("/v2/trace/setting", "/v2/models/{name}/trace/setting"):
        route("GET", base, "rest:v2_trace_setting", trace_setting)
        route("POST", base, "rest:v2_trace_setting", trace_setting)
    route("POST", "/v2/repository/index", "rest:v2_repository", repository)
    # a load answers once the model serves, however long that takes (as over gRPC without a deadline)
    route("POST", "/v2/repository/models/{name}/{action:load|unload}", "rest:v2_repository", repository, False)


def _shared_bytes(doc) -> int:
    """The bytes a request's inputs read from shared memory (each a copy): with the body's, what decides whether
    they decode on a worker thread. A few hundred bytes of JSON may name a region of hundreds of MiB."""
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    total = 0
    for tensor in inputs if isinstance(inputs, list) else ():
        params = tensor.get("parameters") if isinstance(tensor, dict) else None
        if isinstance(params, dict) and v2_types.SHARED_MEMORY_REGION in params:
            size = params.get("shared_memory_byte_size")
            total += size if isinstance(size, int) and size > 0 else 0
    return total


def _version(request: web.Request) -> int | None:
    text = request.match_info.get("version")
    if text is None:
        return None
    # 19 digits: int64; never int() thousands of digits
    if not text.isdigit() or not text.isascii() or len(text) > 19 or int(text) > _INT64_MAX:
        raise InvalidArgument(f"model version {_cut(text)!r} is not a version number: use e.g. /versions/1")
    return int(text)


def _cut(text: str, limit: int = 40) -> str:
    """``text`` for an error message, cut to about ``limit`` characters."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


async def repository(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    """Triton's model repository extension (server/protocols/kserve/repository.py): POST /v2/repository/index
    (``{"ready": bool}``)
    answers the models and their versions' states; .../models/{name}/load and /unload. Served here only in explicit
    model control of a Triton model repository, as Triton serves it; else on the admin port, over gRPC."""
    models = rest.core.model_repository
    if models is None:
        raise Unimplemented(
            "the model repository extension is served over gRPC on the admin port (--admin_port), not over REST "
            "(REST serves it with --model-repository and --model-control-mode=explicit)"
        )
    models.check_access("http", request.headers.items())
    body = await rest.body(request, json=True)
    doc = _dict(codec.parse(memoryview(body), "repository request JSON"), "the request") if len(body) else {}
    action = request.match_info.get("action")
    if action is None:
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgument(f"'ready' must be true or false, got {codec.show(ready)}")
        entries = await models.index(ready)
        return json_response(codec.dumps([{k: v for k, v in entry.items() if v} for entry in entries]))
    name = request.match_info["name"]
    if action == "load":
        models.check(name, "load")
        parameters = _dict(doc.get("parameters", {}), "parameters")
        models.check_parameters(name, parameters)
        base_path = parameters.get(BASE_PATH)
        if base_path is not None and (not isinstance(base_path, str) or not base_path):
            raise InvalidArgument(f"failed to load {name!r}: parameter {BASE_PATH!r} must be a string naming a folder")
        await models.load(name, base_path)
    else:
        await models.unload(name)
    return web.Response(status=200)


# -- Triton's system shared memory extension (server/protocols/kserve/shared_memory.py)-------------------------------


async def shared_memory_status(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    return json_response(codec.dumps(rest.core.shared_memory.status(request.match_info.get("region", ""))))


async def shared_memory_register(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    region = request.match_info["region"]
    doc = _dict(codec.parse(memoryview(await rest.body(request, json=True)), "register request JSON"), "the request")
    key = doc.get("key")
    if not isinstance(key, str):
        raise InvalidArgument(f"'key' must be a string naming the shared memory (e.g. '/name'), got {codec.show(key)}")
    offset = _integer(doc.get("offset", 0), "offset", "bytes into the shared memory")
    size = _integer(doc.get("byte_size"), "byte_size", "the region's size in bytes")
    rest.core.shared_memory.register(region, key, offset, size)
    return web.Response(status=200)


async def shared_memory_unregister(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    rest.core.shared_memory.unregister(request.match_info.get("region", ""))
    return web.Response(status=200)


async def logging_settings(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    """Triton's log settings: GET reads them, POST changes those its JSON object names
    (server/protocols/kserve/v2_settings.py)."""
    changes = {}
    if request.method == "POST":
        body = await rest.body(request, json=True)
        changes = _dict(codec.parse(memoryview(body), "log settings JSON"), "the request")
    return json_response(codec.dumps(rest.core.log_settings.update(changes)))


async def trace_setting(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    """Triton's trace settings: servex traces no requests (trace_level ["OFF"]); a POST asking for tracing is 501."""
    changes: dict[str, list[str]] = {}
    if request.method == "POST":
        doc = _dict(codec.parse(memoryview(await rest.body(request, json=True)), "trace settings JSON"), "the request")
        for key, value in doc.items():  # a string, a list of strings, or null (clear the setting)
            changes[key] = [] if value is None else [str(v) for v in value] if isinstance(value, list) else [str(value)]
    settings = v2_settings.trace_settings(rest.core, request.match_info.get("name", ""), changes)
    return json_response(codec.dumps(settings))


async def cuda_shared_memory(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    raise Unimplemented(NO_CUDA_MEMORY)


# Registering CUDA shared memory is 501, so there is never a region to list or unregister: status and unregister
# answer as a Triton without GPUs does (Triton's examples unregister all CUDA regions before they start).
async def cuda_shared_memory_status(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    return json_response(codec.dumps(rest.core.shared_memory.cuda_status(request.match_info.get("region", ""))))


async def cuda_shared_memory_unregister(
    rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    return web.Response(status=200)


def _place(params: dict, where: str, tensor: str) -> tuple[str, int, int]:
    """An input's or output's place in shared memory from its JSON parameters: region, offset, byte size."""
    region = params[v2_types.SHARED_MEMORY_REGION]
    if not isinstance(region, str):
        raise InvalidArgument(f"{where}.shared_memory_region must be a string naming a region, got "
                              f"{codec.show(region)}")  # fmt: skip
    if "shared_memory_byte_size" not in params:
        raise InvalidArgument(f"{tensor}: a shared memory region needs parameters.shared_memory_byte_size")
    size = _integer(params["shared_memory_byte_size"], f"{where}.shared_memory_byte_size", "bytes")
    offset = _integer(params.get("shared_memory_offset", 0), f"{where}.shared_memory_offset", "bytes")
    return region, offset, size


# -- health and metadata ----------------------------------------------------------------------------------


def _server_version() -> str:
    try:
        return metadata.version("servex")
    except metadata.PackageNotFoundError:
        return "0.0.0"


_SERVER = codec.dumps({"name": "servex", "version": _server_version(), "extensions": v2_types.EXTENSIONS})
# With the model repository extension here (explicit model control of a Triton model repository)
_SERVER_WITH_REPOSITORY = codec.dumps(
    {"name": "servex", "version": _server_version(), "extensions": [*v2_types.EXTENSIONS, "model_repository"]}
)


async def server_metadata(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    return json_response(_SERVER if rest.core.model_repository is None else _SERVER_WITH_REPOSITORY)


# The health answers carry KServe's JSON objects (kserve's InferenceRESTClient reads "live" and "ready" from them);
# Triton's are empty, and tritonclient reads the status only.
_LIVE = codec.dumps({"live": True})
_READY = codec.dumps({"ready": True})


async def live(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    return json_response(_LIVE)


async def ready(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    if rest.draining:
        raise HttpError("servex is shutting down", "UNAVAILABLE", 400)
    if not rest.core.ready():
        raise HttpError("not ready: the models to serve at start are loading, or none is available", "UNAVAILABLE",
                        400)  # fmt: skip
    return json_response(_READY)


async def model_ready(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    try:
        served = rest.core.resolve(call.model, _version(request))
    except ServingError as e:  # not ready: 404 when it does not exist, else 400 (v2: any 4xx means false)
        raise HttpError(e.message, e.code, 404 if isinstance(e, NotFound) else 400) from None
    if rest.draining:
        raise HttpError("servex is shutting down", "UNAVAILABLE", 400)
    return json_response(codec.dumps({"name": served.name, "ready": True}))


_METADATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # served version -> its answer


async def model_metadata(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    core = rest.core
    served = core.resolve(call.model, _version(request))
    body = _METADATA.get(served)
    if body is None:
        # A model without serving_default (which infer runs unless asked for another signature) has no default
        # inputs or outputs to describe; it serves all the same (ready), so its metadata is not an error.
        sig = served.servable.model.signatures.get(DEFAULT_SIGNATURE)
        versions = [str(s.version) for s in core.manager.statuses(served.name) if s.state == "AVAILABLE"]
        body = _METADATA[served] = codec.dumps(
            {
                "name": served.name,
                "versions": versions,
                "platform": PLATFORM,
                # In name order, as gRPC's ModelMetadata and the model config list them.
                "inputs": [_tensor_metadata(a, s) for a, s in sorted(sig.inputs.items())] if sig else [],
                "outputs": [_tensor_metadata(a, sig.outputs[a]) for a in sig.output_aliases] if sig else [],
            }
        )
    return json_response(body)


async def model_config(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    return json_response(codec.dumps(v2_config.model_config(rest.core, call.model, _version(request))))


async def model_statistics(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    return json_response(codec.dumps(v2_stats.model_statistics(rest.core, call.model, _version(request))))


def _tensor_metadata(alias: str, spec) -> dict:
    try:
        datatype = v2_types.datatype(spec.dtype)
    except ValueError:
        datatype = np.dtype(spec.dtype).name.upper()
    shape = [-1] if spec.shape is None else [-1 if d is None else d for d in spec.shape]
    return {"name": alias, "datatype": datatype, "shape": shape}


# -- infer ------------------------------------------------------------------------------------------------


async def infer(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.StreamResponse:
    version = _version(request)
    body = await rest.body(request)
    view = memoryview(body)
    header = request.headers.get(HEADER_LENGTH)
    json_size = len(view)
    if header is not None:
        digits = header.strip()
        # at most 19 digits (int64): never int() thousands of them
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 19 or int(digits) > len(view):
            raise InvalidArgument(
                f"header {HEADER_LENGTH} is {_cut(header)!r}: expected the byte length of the JSON at the start of "
                f"the body, at most the body's {len(view)} bytes"
            )
        json_size = int(digits)
    rest.check_json_size(json_size)
    doc = await offload(json_size, codec.parse, view[:json_size], "inference request JSON")
    request_id, signature, binary_output, filters, classes, places = _parameters(doc, info)
    shared = rest.core.shared_memory
    started = time.perf_counter()
    inputs = await offload(len(view) + _shared_bytes(doc), decode_inputs, doc, view[json_size:], shared)
    del doc  # the parsed JSON takes many times the inputs' memory: gone before the run
    info.compute_input = time.perf_counter() - started
    result = await rest.core.predict(call.model, version, "", signature, inputs, list(filters), "outputs")
    started = time.perf_counter()
    outputs = v2_types.classified(result.outputs, classes)
    reply: dict[str, Any] = {"model_name": result.model_name, "model_version": str(result.version)}
    if request_id:  # an empty id is not echoed, as Triton leaves it out
        reply["id"] = request_id
    chunks: list = []

    def encode() -> bytes:  # with NaN or infinities the standard library writes the JSON: slow, large or not
        reply["outputs"], all_finite = encode_outputs(outputs, filters, binary_output, chunks, shared, places)
        return codec.dumps(reply, all_finite)

    text = await offload(payload_bytes(outputs.values()), encode)
    info.compute_output = time.perf_counter() - started
    if not chunks:
        return json_response(text)
    if accepts_compression(request):  # one body, which the endpoint wrapper compresses
        return web.Response(body=b"".join([text, *chunks]), headers={HEADER_LENGTH: str(len(text))},
                            content_type="application/octet-stream")  # fmt: skip
    response = web.StreamResponse(headers={HEADER_LENGTH: str(len(text))})
    response.content_type = "application/octet-stream"
    response.content_length = len(text) + sum(len(c) for c in chunks)
    await response.prepare(request)
    await response.write(text)
    for chunk in chunks:
        await response.write(chunk)
    await response.write_eof()
    return response


def _parameters(doc: Any, info: RequestInfo) -> tuple[Any, str, bool, dict[str, bool], dict[str, int], dict]:
    """The request's id, signature, binary_data_output, requested outputs (name -> binary), classifications
    asked (name -> top N) and outputs' places in shared memory (name -> region, offset, byte size); sets the
    call's priority and deadline from ``parameters``."""
    if not isinstance(doc, dict):
        raise InvalidArgument(
            f'the inference request is a JSON {codec.type_name(doc)}, expected an object {{"inputs": [...], ...}}'
        )
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidArgument(f"'id' must be a string, got {codec.type_name(request_id)}")
    params = _dict(_given(doc, "parameters", {}), "parameters")
    if "priority" in params:
        info.priority = checked_priority(
            _integer(params["priority"], "parameters.priority", "larger runs first"), "parameters.priority"
        )
    if "timeout" in params:
        micros = _integer(params["timeout"], "parameters.timeout", "microseconds")
        if micros > 0:  # 0 (Triton's default) means no timeout
            deadline = time.monotonic() + micros / 1e6
            info.deadline = deadline if info.deadline is None else min(info.deadline, deadline)
    binary_output = _boolean(params.get("binary_data_output", False), "parameters.binary_data_output")
    signature = params.get("signature_name", "")
    if not isinstance(signature, str):
        raise InvalidArgument(f"parameters.signature_name must be a string, got {codec.type_name(signature)}")
    outputs = _given(doc, "outputs", [])
    if not isinstance(outputs, list):
        raise InvalidArgument(f"'outputs' must be a list of {{\"name\": ...}} objects, got {codec.type_name(outputs)}")
    filters: dict[str, bool] = {}
    classes: dict[str, int] = {}
    places: dict[str, tuple[str, int, int]] = {}
    for i, out in enumerate(outputs):
        out = _dict(out, f"outputs[{i}]")
        name = out.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"outputs[{i}] has no 'name' (a string naming the output)")
        if name in filters:
            raise InvalidArgument(f"output {name!r} is requested twice")
        out_params = _dict(_given(out, "parameters", {}), f"outputs[{i}].parameters")
        if v2_types.CLASSIFICATION in out_params:
            count = _integer(out_params[v2_types.CLASSIFICATION], f"outputs[{i}].parameters.classification", "top N")
            classes[name] = v2_types.classification_count(count, name)
        if v2_types.SHARED_MEMORY_REGION in out_params:
            places[name] = _place(out_params, f"outputs[{i}].parameters", f"output {name!r}")
        # A named output is JSON unless it asks for binary itself: binary_data_output covers the outputs the
        # request does not name (Triton's rule).
        filters[name] = _boolean(out_params.get("binary_data", False), f"outputs[{i}].parameters.binary_data")
    return request_id, signature, binary_output, filters, classes, places


def _given(doc: dict, key: str, default: Any) -> Any:
    """``doc[key]``, ``default`` when it is absent or null: KServe's own JSON (its pydantic models, answers passed
    on as requests) writes ``"parameters": null`` for no parameters."""
    value = doc.get(key)
    return default if value is None else value


def _dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgument(f"'{where}' must be a JSON object, got {codec.type_name(value)}")
    return value


def _integer(value: Any, where: str, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > _INT64_MAX:
        raise InvalidArgument(f"{where} must be an integer ({meaning}), got {codec.show(value)}")
    return value


def _boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{where} must be true or false, got {codec.show(value)}")
    return value


def decode_inputs(doc: dict, binary: memoryview, shared) -> dict[str, np.ndarray]:
    """The request's inputs by name: JSON ``data``, ``binary_data_size`` bytes of ``binary`` each, in order, or
    bytes of a shared memory region (``shared``, a SharedMemoryRegistry) read without a copy."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InvalidArgument(
            'the request has no \'inputs\': send a list of {"name", "shape", "datatype", "data"} objects'
        )
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for i, tensor in enumerate(inputs):
        tensor = _dict(tensor, f"inputs[{i}]")
        name = tensor.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"inputs[{i}] has no 'name' (a string naming the input)")
        if name in arrays:
            raise InvalidArgument(f"input {name!r} is sent twice")
        datatype = tensor.get("datatype")
        if not isinstance(datatype, str):
            raise InvalidArgument(f"input {name!r} has no 'datatype'; expected one of {', '.join(v2_types.DTYPES)}")
        dtype = v2_types.numpy_dtype(datatype, name)
        shape = tensor.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise InvalidArgument(f"input {name!r}: 'shape' must be a list of integers, got {codec.show(shape)}")
        count = v2_types.element_count(shape, name)
        params = _dict(_given(tensor, "parameters", {}), f"inputs[{i}].parameters")
        if v2_types.SHARED_MEMORY_REGION in params:
            if "data" in tensor or "binary_data_size" in params:
                raise InvalidArgument(f"input {name!r} has data and a shared memory region: send one of them")
            region, start, size = _place(params, f"inputs[{i}].parameters", f"input {name!r}")
            raw = shared.read(region, start, size, name)
        elif "binary_data_size" in params:
            size = params["binary_data_size"]
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidArgument(f"input {name!r}: binary_data_size must be a byte count, got {codec.show(size)}")
            if "data" in tensor:
                raise InvalidArgument(f"input {name!r} has both 'data' and binary_data_size: send one of them")
            if offset + size > len(binary):
                raise InvalidArgument(
                    f"input {name!r}: binary_data_size {size} runs past the binary data: {len(binary) - offset} "
                    f"bytes are left after the earlier inputs ({len(binary)} after the JSON in all)"
                )
            raw = binary[offset : offset + size]
            offset += size
        elif "data" in tensor:
            arrays[name] = _from_data(tensor["data"], datatype, dtype, shape, count, name, i)
            continue
        else:
            raise InvalidArgument(f"input {name!r} has no 'data' and no parameters.binary_data_size")
        arrays[name] = v2_types.from_raw(raw, datatype, shape, name)
    if offset != len(binary):
        raise InvalidArgument(
            f"{len(binary) - offset} bytes of binary data are left after the inputs' binary_data_size "
            f"({offset} bytes in all): every byte after the JSON must belong to an input"
        )
    return arrays


def _from_data(data: Any, datatype: str, dtype: np.dtype, shape: list, count: int, name: str, i: int) -> np.ndarray:
    expects = f"input {name!r} ({datatype} {shape})"
    where = f"inputs[{i}].data"
    if dtype.kind == "O":
        leaves: list = []
        _leaves(data, leaves)
        bad = next((v for v in leaves if not isinstance(v, str)), None)
        if bad is not None:
            raise InvalidArgument(f"{expects}: {where} holds {codec.show(bad)}, expected strings for BYTES")
        array = np.empty(len(leaves), dtype=object)
        array[:] = [v.encode() for v in leaves]
    else:
        array = codec.to_array(data, dtype, where, expects)
    if array.size != count:
        raise InvalidArgument(f"{expects}: {where} holds {array.size} values, but shape {shape} takes {count}")
    return array.reshape(shape)


def _leaves(value: Any, out: list) -> None:
    if isinstance(value, list):
        for item in value:
            _leaves(item, out)
    else:
        out.append(value)


def encode_outputs(
    outputs: dict[str, np.ndarray],
    filters: dict[str, bool],
    binary_output: bool,
    chunks: list,
    shared=None,
    places: dict | None = None,
) -> tuple[list[dict], bool]:
    """The answer's ``outputs`` entries; raw data of binary outputs is appended to ``chunks`` in order, that of
    outputs with a place in shared memory (``places``) written there (``shared``) and left out of the answer."""
    entries = []
    all_finite = True
    for name, array in outputs.items():
        try:
            datatype = v2_types.datatype(array.dtype)
        except ValueError:
            raise FailedPrecondition(
                f"output {name!r} has dtype {array.dtype.name}, which the KServe v2 protocol cannot carry "
                f"(use TensorFlow Serving's REST or gRPC Predict for it)"
            ) from None
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if places and name in places:
            region, offset, size = places[name]
            data = v2_types.to_raw(array)
            shared.write(region, offset, data, size, name)
            entry["parameters"] = {v2_types.SHARED_MEMORY_REGION: region, "shared_memory_byte_size": len(data)}
        elif filters.get(name, binary_output):
            raw = raw_view(array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        elif datatype == v2_types.BYTES:
            entry["data"] = [_text(v, name) for v in array.reshape(-1).tolist()]
        else:
            all_finite = all_finite and codec.finite(array)
            entry["data"] = codec.jsonable(array.reshape(-1))
        entries.append(entry)
    return entries, all_finite


def _text(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        raise InvalidArgument(
            f"output {name!r} holds bytes that are not UTF-8 text, which JSON cannot carry: ask for it with "
            f'"parameters": {{"binary_data": true}}'
        ) from None


def raw_view(array: np.ndarray) -> bytes | memoryview:
    """An output's raw v2 bytes: a view over the array when it is little-endian and contiguous already."""
    if array.dtype.kind in "OSU":
        return v2_types.encode_bytes(array)
    flat = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).reshape(-1)
    return memoryview(flat.view(np.uint8))
