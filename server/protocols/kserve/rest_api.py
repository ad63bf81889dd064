"""KServe v2 (Open Inference Protocol) REST, as tritonclient.http speaks it: an adapter over the KServe data plane
(server/protocols/kserve/dataplane.py), which answers every call as gRPC's adapter gets it answered; here the JSON,
the binary tensor extension (server/protocols/kserve/rest_tensors.py) and the HTTP statuses.

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
- Request parameters (checked by the data plane, server/protocols/kserve/dataplane_rules.py): ``priority``
  (integer, larger runs first: servex's priority, as the header ``x-servex-priority``), ``timeout`` (microseconds:
  the run must start within it, else 504), ``signature_name`` (servex's extension: the signature to run, default
  ``serving_default``).

Every ``GET`` endpoint answers ``HEAD`` too; another method on an endpoint's path is 405 with ``Allow``. Errors are
``{"error": "..."}`` with the status of server/transport/http.py's mapping.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from servex.loader.errors import InvalidArgument, NotFound, Unimplemented
from servex.server.core import RequestInfo
from servex.server.protocols.kserve.dataplane import DataPlane, repository_index, repository_load, repository_unload
from servex.server.protocols.kserve.dataplane_rules import InferRequest, cut
from servex.server.protocols.kserve.rest_tensors import as_dict, decode_inputs, encode_outputs, given, shared_bytes
from servex.server.transport import json_codec as codec
from servex.server.transport.compression import accepts_compression
from servex.server.transport.http import (
    Call,
    HttpError,
    Rest,
    json_response,
    offload,
    payload_bytes,
)

HEADER_LENGTH = "Inference-Header-Content-Length"


def add_routes(app: web.Application, rest: Rest, plane: DataPlane) -> None:
    """The ``/v2`` routes over ``plane`` (the app's one, which gRPC's adapter shares)."""

    def route(method: str, path: str, name: str, handler, bounded: bool = True) -> None:
        endpoint = rest.endpoint(name, lambda r, c, i: handler(plane, rest, r, c, i), bounded)
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


def _version(request: web.Request) -> str:
    return request.match_info.get("version", "")


def _json(body: bytes, what: str) -> dict:
    return as_dict(codec.parse(memoryview(body), what), "the request") if len(body) else {}


async def repository(plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    """Triton's model repository extension (server/protocols/kserve/repository.py): POST /v2/repository/index
    (``{"ready": bool}``) answers the models and their versions' states; .../models/{name}/load and /unload. Served
    here only in explicit model control of a Triton model repository, as Triton serves it; else on the admin port,
    over gRPC."""
    models = plane.repository
    if models is None:
        raise Unimplemented(
            "the model repository extension is served over gRPC on the admin port (--admin_port), not over REST "
            "(REST serves it with --model-repository and --model-control-mode=explicit)"
        )
    models.check_access("http", request.headers.items())
    doc = _json(await rest.body(request, json=True), "repository request JSON")
    action = request.match_info.get("action")
    if action is None:
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgument(f"'ready' must be true or false, got {codec.show(ready)}")
        entries = await repository_index(models, "", ready)
        return json_response(codec.dumps([{k: v for k, v in entry.items() if v} for entry in entries]))
    name = request.match_info["name"]
    if action == "load":
        await repository_load(models, "", name, as_dict(doc.get("parameters", {}), "parameters"))
    else:
        await repository_unload(models, "", name)
    return web.Response(status=200)


# -- Triton's system shared memory extension (server/protocols/kserve/shared_memory.py)-------------------------------


async def shared_memory_status(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    return json_response(codec.dumps(plane.shared_memory_status(request.match_info.get("region", ""))))


async def shared_memory_register(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    region = request.match_info["region"]
    doc = as_dict(codec.parse(memoryview(await rest.body(request, json=True)), "register request JSON"), "the request")
    plane.register_shared_memory(region, doc.get("key"), doc.get("offset", 0), doc.get("byte_size"))
    return web.Response(status=200)


async def shared_memory_unregister(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    plane.unregister_shared_memory(request.match_info.get("region", ""))
    return web.Response(status=200)


async def logging_settings(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    """Triton's log settings: GET reads them, POST changes those its JSON object names
    (server/protocols/kserve/v2_settings.py)."""
    changes = {}
    if request.method == "POST":
        body = await rest.body(request, json=True)
        changes = as_dict(codec.parse(memoryview(body), "log settings JSON"), "the request")
    return json_response(codec.dumps(plane.update_log_settings(changes)))


async def trace_setting(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    """Triton's trace settings: servex traces no requests (trace_level ["OFF"]); a POST asking for tracing is 501."""
    changes: dict[str, list[str]] = {}
    if request.method == "POST":
        body = await rest.body(request, json=True)
        doc = as_dict(codec.parse(memoryview(body), "trace settings JSON"), "the request")
        for key, value in doc.items():  # a string, a list of strings, or null (clear the setting)
            changes[key] = [] if value is None else [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return json_response(codec.dumps(plane.trace_settings(request.match_info.get("name", ""), changes)))


async def cuda_shared_memory(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    plane.register_cuda_shared_memory()  # 501
    return web.Response(status=200)


async def cuda_shared_memory_status(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    return json_response(codec.dumps(plane.cuda_shared_memory_status(request.match_info.get("region", ""))))


async def cuda_shared_memory_unregister(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    plane.unregister_cuda_shared_memory(request.match_info.get("region", ""))
    return web.Response(status=200)


# -- health and metadata ----------------------------------------------------------------------------------

# The health answers carry KServe's JSON objects (kserve's InferenceRESTClient reads "live" and "ready" from them);
# Triton's are empty, and tritonclient reads the status only.
_LIVE = codec.dumps({"live": True})
_READY = codec.dumps({"ready": True})


async def server_metadata(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    return json_response(codec.dumps(plane.server_metadata().as_dict()))


async def live(plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    return json_response(_LIVE)


async def ready(plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.Response:
    if rest.draining:
        raise HttpError("servex is shutting down", "UNAVAILABLE", 400)
    if not plane.server_ready():
        raise HttpError("not ready: the models to serve at start are loading, or none is available", "UNAVAILABLE",
                        400)  # fmt: skip
    return json_response(_READY)


async def model_ready(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    readiness = plane.model_ready(call.model, _version(request))
    if readiness.error is not None:  # not ready: 404 when it does not exist, else 400 (v2: any 4xx means false)
        e = readiness.error
        raise HttpError(e.message, e.code, 404 if isinstance(e, NotFound) else 400)
    if rest.draining:
        raise HttpError("servex is shutting down", "UNAVAILABLE", 400)
    return json_response(codec.dumps({"name": readiness.name, "ready": True}))


async def model_metadata(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    return json_response(codec.dumps(plane.model_metadata(call.model, _version(request)).as_dict()))


async def model_config(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    return json_response(codec.dumps(plane.model_config(call.model, _version(request))))


async def model_statistics(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.Response:
    return json_response(codec.dumps(plane.model_statistics(call.model, _version(request))))


# -- infer ------------------------------------------------------------------------------------------------


async def infer(
    plane: DataPlane, rest: Rest, request: web.Request, call: Call, info: RequestInfo
) -> web.StreamResponse:
    body = await rest.body(request)
    view = memoryview(body)
    json_size = _json_size(request.headers.get(HEADER_LENGTH), len(view))
    rest.check_json_size(json_size)
    doc = await offload(json_size, codec.parse, view[:json_size], "inference request JSON")
    v2 = infer_request(call.model, _version(request), doc, info)
    shared = plane.shared_memory
    started = time.perf_counter()
    v2.inputs = await offload(len(view) + shared_bytes(doc), decode_inputs, doc, view[json_size:], shared)
    del doc  # the parsed JSON takes many times the inputs' memory: gone before the run
    info.compute_input = time.perf_counter() - started
    answer = await plane.infer(v2)
    started = time.perf_counter()
    reply: dict[str, Any] = {"model_name": answer.model_name, "model_version": answer.model_version}
    if answer.id:  # an empty id is not echoed, as Triton leaves it out
        reply["id"] = answer.id
    chunks: list = []

    def encode() -> bytes:  # with NaN or infinities the standard library writes the JSON: slow, large or not
        outputs, binary, places = answer.outputs, v2.binary(), v2.places()
        reply["outputs"], all_finite = encode_outputs(outputs, binary, v2.binary_output, chunks, shared, places)
        return codec.dumps(reply, all_finite)

    text = await offload(payload_bytes(answer.outputs.values()), encode)
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


def _json_size(header: str | None, body_size: int) -> int:
    """The byte length of the JSON at the start of the body: the binary tensor extension's header, else all of it."""
    if header is None:
        return body_size
    digits = header.strip()
    # at most 19 digits (int64): never int() thousands of them
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 19 or int(digits) > body_size:
        raise InvalidArgument(
            f"header {HEADER_LENGTH} is {cut(header)!r}: expected the byte length of the JSON at the start of "
            f"the body, at most the body's {body_size} bytes"
        )
    return int(digits)


def infer_request(model: str, version: str, doc: Any, info: RequestInfo | None = None) -> InferRequest:
    """The data plane's request from the JSON (its inputs left to decode): id, parameters and outputs as the JSON
    has them (null taken as absent, as KServe writes them); the data plane checks the values."""
    if not isinstance(doc, dict):
        raise InvalidArgument(
            f'the inference request is a JSON {codec.type_name(doc)}, expected an object {{"inputs": [...], ...}}'
        )
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidArgument(f"'id' must be a string, got {codec.type_name(request_id)}")
    params = as_dict(given(doc, "parameters", {}), "parameters")
    outputs = given(doc, "outputs", [])
    if not isinstance(outputs, list):
        raise InvalidArgument(f"'outputs' must be a list of {{\"name\": ...}} objects, got {codec.type_name(outputs)}")
    named = []
    for i, out in enumerate(outputs):
        out = as_dict(out, f"outputs[{i}]")
        named.append((out.get("name"), as_dict(given(out, "parameters", {}), f"outputs[{i}].parameters")))
    return DataPlane.infer_request(model, version, request_id or "", params, named, info)
