"""TensorFlow Serving's REST API over the ServingCore, answering as TensorFlow Serving does
(tensorflow_serving/model_servers/http_rest_api_handler.cc, util/json_tensor.cc):

- ``GET /v1/models/{name}[/versions/{v}|/labels/{l}]``: model status, GetModelStatusResponse as protobuf's JSON
  (``{"model_version_status": [{"version": "1", "state": "AVAILABLE", "status": {...}}]}``).
- ``GET .../metadata``: ``{"model_spec": {...}, "metadata": {"signature_def": <SignatureDefMap as JSON>}}``.
- ``POST ...:predict``: row format ``{"instances": [...]}`` answered ``{"predictions": [...]}``, or columnar
  ``{"inputs": ...}`` answered ``{"outputs": ...}``; optional ``signature_name``. DT_STRING values are JSON
  strings or ``{"b64": "..."}``; a DT_STRING output whose alias ends in ``_bytes`` is written ``{"b64": ...}``.
- ``POST ...:classify`` / ``...:regress``: ``{"examples": [...], "context": {...}}`` in TensorFlow Serving's JSON
  tf.Example format, run by server/protocols/tfserving/examples.py's steps as the gRPC Classify/Regress; ``{"results":
  [...]}``. The
  JSON becomes serialized tf.Examples, and the results JSON, on a worker thread when the body is large
  (``EXAMPLES_OFFLOAD_BYTES``), so that a small compressed body of millions of examples holds no other call.

Paths are matched case-insensitively with TensorFlow Serving's own patterns (``HEAD`` as ``GET``); any other
``/v1/`` path is 400 "Malformed request". Errors are ``{"error": "..."}`` with the status of server/transport/http.py's
mapping.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import time
import weakref
from typing import Any
from urllib.parse import unquote

import numpy as np
from aiohttp import web
from google.protobuf import json_format
from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow_serving.apis import classification_pb2, input_pb2, regression_pb2

from servex.loader.errors import InvalidArgument, NotFound
from servex.loader.saved_model import TensorSpec
from servex.server.core import REQUEST, RequestInfo
from servex.server.protocols.tfserving import examples, request_logging
from servex.server.protocols.tfserving.grpc_api import in_tfserving_words, model_status_response
from servex.server.transport import json_codec as codec
from servex.server.transport.http import Call, Rest, json_response, offload, payload_bytes

_SPEC = r"/v1/models/([^/:]+)(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?"
PREDICT_PATH = re.compile(_SPEC + r":(classify|regress|predict)", re.IGNORECASE)
STATUS_PATH = re.compile(r"/v1/models(?:/([^/:]+))?(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?(?:/(metadata))?", re.I)
_INT64_MAX = 2**63 - 1
# Classify/regress bodies of this many bytes or more become tf.Examples (and their results JSON) on a worker thread:
# a tf.Example built and serialized per example and a result read back cost about 0.25 us of Python per byte of
# JSON (a 1 MiB body: a quarter of a second of the event loop), so from 64 KiB (about 15 ms) on.
EXAMPLES_OFFLOAD_BYTES = 64 << 10
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def add_routes(app: web.Application, rest: Rest) -> None:
    handler = rest.endpoint("rest:malformed", lambda request, call, info: dispatch(rest, request, call, info))
    app.router.add_route("*", r"/{v1:[vV]1}/{tail:.*}", handler)


async def dispatch(rest: Rest, request: web.Request, call: Call, info: RequestInfo) -> web.StreamResponse:
    try:
        return await _dispatch(rest, request, call)
    except NotFound as e:  # an unknown model or version, in TensorFlow Serving's words
        raise in_tfserving_words(e) from e


async def _dispatch(rest: Rest, request: web.Request, call: Call) -> web.StreamResponse:
    path = request.rel_url.raw_path
    if request.method == "POST" and (match := PREDICT_PATH.fullmatch(path)):
        name, version, label = _spec(match)
        verb = match.group(4).lower()
        call.method, call.model = f"rest:{verb}", name
        if verb == "predict":
            return await predict(rest, request, name, version, label)
        return await classify_regress(rest, request, verb, name, version, label)
    if request.method in ("GET", "HEAD") and (match := STATUS_PATH.fullmatch(path)):
        name, version, label = _spec(match)
        metadata = match.group(4) is not None
        call.method, call.model = ("rest:model_metadata" if metadata else "rest:model_status"), name
        if not name:
            raise InvalidArgument("Missing model name in request: GET /v1/models/{name}")
        return await (model_metadata if metadata else model_status)(rest, name, version, label)
    raise InvalidArgument(
        f"Malformed request: {request.method} {path}; expected GET /v1/models/NAME[/versions/N|/labels/LABEL]"
        f"[/metadata] or POST /v1/models/NAME[/versions/N|/labels/LABEL]:predict|classify|regress"
    )


def _spec(match: re.Match) -> tuple[str, int | None, str]:
    name = unquote(match.group(1) or "")
    version = None
    if match.group(2):
        text = match.group(2)
        if len(text) > 19 or int(text) > _INT64_MAX:  # 19 digits: int64; never int() thousands of digits
            shown = text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"
            raise InvalidArgument(f"Failed to convert version: {shown} to numeric (it exceeds int64)")
        version = int(text)
    return name, version, unquote(match.group(3) or "")


async def _document(rest: Rest, request: web.Request) -> tuple[dict, int]:
    """The request's JSON object and its size in bytes (decompressed)."""
    body = await rest.body(request, json=True)
    doc = await offload(len(body), codec.parse, body)
    if not isinstance(doc, dict):
        raise InvalidArgument(
            f"the request body is a JSON {codec.type_name(doc)}, expected an object such as "
            f'{{"instances": [...]}}, {{"inputs": ...}} or {{"examples": [...]}}'
        )
    signature_name = doc.get("signature_name", "")
    if not isinstance(signature_name, str):
        raise InvalidArgument(
            f"'signature_name' must be a string, got {codec.show(signature_name)} ({codec.type_name(signature_name)})"
        )
    return doc, len(body)


# -- predict ----------------------------------------------------------------------------------------------


async def predict(rest: Rest, request: web.Request, name: str, version: int | None, label: str) -> web.Response:
    doc, size = await _document(rest, request)
    signature_name = doc.get("signature_name", "")
    core = rest.core
    sig = core.signature(core.resolve(name, version, label), signature_name)
    info, started = REQUEST.get(), time.perf_counter()
    inputs, row = await offload(size, decode_predict, doc, sig.inputs)
    del doc  # the parsed JSON takes many times the inputs' memory: gone before the run
    info.compute_input = time.perf_counter() - started
    result = await core.predict(name, version, label, signature_name, inputs)
    request_logging.rest_predict(name, version, label, signature_name, inputs, result)
    started = time.perf_counter()
    text = await offload(payload_bytes(result.outputs.values()), encode_predict, result.outputs, row)
    info.compute_output = time.perf_counter() - started
    return json_response(text)


def decode_predict(doc: dict, specs: dict[str, TensorSpec]) -> tuple[dict[str, np.ndarray], bool]:
    """The inputs of a predict request body by alias, and whether it is in the row format (``instances``)."""
    if not specs:
        raise InvalidArgument("the signature has no inputs to fill from 'instances' or 'inputs'")
    if "instances" in doc and "inputs" in doc:
        raise InvalidArgument("the request has both 'instances' and 'inputs': send exactly one of them")
    if "instances" in doc:
        return _decode_instances(doc["instances"], specs), True
    if "inputs" in doc:
        return _decode_inputs(doc["inputs"], specs), False
    raise InvalidArgument(
        f"Missing 'inputs' or 'instances' key: the request has {sorted(doc) or 'no keys'}; send "
        f'{{"instances": [...]}} (row format) or {{"inputs": ...}} (columnar format)'
    )


def _expects(alias: str, spec: TensorSpec) -> str:
    return f"input {alias!r} ({spec.describe()})"


def _is_b64(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get("b64"), str)


def _is_named(value: Any) -> bool:
    return isinstance(value, dict) and not _is_b64(value)


def _decode_instances(instances: Any, specs: dict[str, TensorSpec]) -> dict[str, np.ndarray]:
    if not isinstance(instances, list):
        raise InvalidArgument(f"'instances' must be a list (one entry per instance), got {codec.type_name(instances)}")
    if not instances:
        raise InvalidArgument("No values in 'instances' array: send at least one instance")
    expected = ", ".join(f"{a} ({s.describe()})" for a, s in sorted(specs.items()))
    if not _is_named(instances[0]):
        if len(specs) > 1:
            raise InvalidArgument(
                f"'instances' is a plain list, but the signature has {len(specs)} inputs: send a list of objects "
                f"with one key per input: {expected}"
            )
        for i, item in enumerate(instances):
            if _is_named(item):
                raise InvalidArgument(f"instances[{i}] is an object, but instances[0] is a value/list: mix not allowed")
        ((alias, spec),) = specs.items()
        return {alias: _to_array(instances, spec, "instances", _expects(alias, spec))}
    columns: dict[str, list] = {alias: [] for alias in specs}
    for i, item in enumerate(instances):
        if not _is_named(item):
            raise InvalidArgument(
                f"instances[{i}] is a {codec.type_name(item)}, but instances[0] is an object: every instance must be "
                f"an object with one key per input: {expected}"
            )
        if item.keys() != specs.keys():
            missing, unknown = sorted(specs.keys() - item.keys()), sorted(item.keys() - specs.keys())
            parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
            raise InvalidArgument(f"instances[{i}] keys: {'; '.join(parts)}; expected inputs: {expected}")
        for alias in specs:
            columns[alias].append(item[alias])
    return {
        alias: _to_array(columns[alias], spec, f"instances[*][{alias!r}]", _expects(alias, spec))
        for alias, spec in specs.items()
    }


def _decode_inputs(inputs: Any, specs: dict[str, TensorSpec]) -> dict[str, np.ndarray]:
    if not _is_named(inputs):
        if len(specs) > 1:
            raise InvalidArgument(
                f"'inputs' is a plain value/list, but the signature has {len(specs)} inputs: send an object with "
                f"one key per input: {', '.join(sorted(specs))}"
            )
        ((alias, spec),) = specs.items()
        return {alias: _to_array(inputs, spec, "inputs", _expects(alias, spec))}
    missing = [alias for alias in specs if alias not in inputs]
    if missing:
        raise InvalidArgument(
            f"Missing named input(s) {missing} in 'inputs' object; expected inputs: "
            + ", ".join(f"{a} ({s.describe()})" for a, s in sorted(specs.items()))
        )
    # Keys that name no input are ignored, as TensorFlow Serving ignores them.
    return {
        alias: _to_array(inputs[alias], spec, f"inputs[{alias!r}]", _expects(alias, spec))
        for alias, spec in specs.items()
    }


def _to_array(value: Any, spec: TensorSpec, where: str, expects: str) -> np.ndarray:
    if codec.dtype_kind(spec.dtype) == "string":
        return _to_strings(value, where, expects)
    return codec.to_array(value, spec.dtype, where, expects)


def _to_strings(value: Any, where: str, expects: str) -> np.ndarray:
    """A DT_STRING tensor from nested lists of strings (UTF-8) and ``{"b64": ...}`` objects."""
    shape = codec.shape_of(value)
    if len(shape) > codec.MAX_DIMS:
        raise InvalidArgument(
            f"{expects}: {where} is nested {len(shape)} levels deep; a tensor has at most {codec.MAX_DIMS} dimensions"
        )
    ragged = codec.ragged_at(value, where)
    if ragged:
        raise InvalidArgument(f"{expects}: the lists are ragged: {ragged}; a tensor's lists must be rectangular")
    flat: list[bytes] = []

    def walk(v: Any, at: str) -> None:
        if isinstance(v, list):
            for i, item in enumerate(v):
                walk(item, f"{at}[{i}]")
        elif isinstance(v, str):
            flat.append(v.encode())
        elif _is_b64(v):
            flat.append(_b64decode(v["b64"], at, expects))
        else:
            raise InvalidArgument(
                f'{expects}: {at} is {codec.show(v)} ({codec.type_name(v)}), expected a string or {{"b64": "<base64>"}}'
            )

    walk(value, where)
    array = np.empty(len(flat), dtype=object)
    array[:] = flat
    return array.reshape(shape)


# What absl::Base64Unescape (TensorFlow Serving's decoder) also takes: whitespace anywhere (base64 wrapped in
# lines, as Python's base64.encodebytes and the base64 tool write it) and '.' as the padding character.
_B64_WHITESPACE = str.maketrans("", "", " \t\n\v\f\r")


def _b64decode(text: str, at: str, expects: str) -> bytes:
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError) as e:
        error = e
    lenient = text.translate(_B64_WHITESPACE)
    unpadded = lenient.rstrip("=.")
    if len(lenient) - len(unpadded) <= 2:
        try:
            return base64.b64decode(unpadded + "=" * (-len(unpadded) % 4), validate=True)
        except (binascii.Error, ValueError):
            pass
    raise InvalidArgument(
        f'{expects}: {at} {{"b64": {codec.show(text, 40)}}} is not valid base64 ({error}); expected standard '
        f"base64 (A-Z, a-z, 0-9, +, /; padding = or ., optional; whitespace is skipped)"
    ) from None


def _strings_json(array: np.ndarray, as_b64: bool) -> Any:
    flat = array.reshape(-1).tolist()
    if as_b64:
        out = [{"b64": base64.b64encode(v if isinstance(v, bytes) else v.encode()).decode()} for v in flat]
    else:
        out = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for v in flat]
    nested = np.empty(len(out), dtype=object)
    nested[:] = out
    return nested.reshape(array.shape).tolist()


def encode_predict(outputs: dict[str, np.ndarray], row: bool) -> bytes:
    """The predict answer: ``{"predictions": ...}`` (row) or ``{"outputs": ...}`` (columnar)."""
    if not outputs:
        raise InvalidArgument("Cannot convert empty tensor map to JSON: the run produced no outputs")
    values: dict[str, Any] = {}
    all_finite = True
    for alias, array in outputs.items():
        if array.dtype.kind in "OSU":
            values[alias] = _strings_json(array, alias.endswith("_bytes"))
        else:
            all_finite = all_finite and codec.finite(array)
            if codec.is_narrow_float(array):  # TensorFlow Serving's decimals for float32
                array = codec.tf_serving_floats(array)
            values[alias] = codec.jsonable(array)
    if not row:
        body = next(iter(values.values())) if len(values) == 1 else values
        return codec.dumps({"outputs": body}, all_finite)
    batch = None
    for alias, array in outputs.items():
        if array.ndim == 0:
            raise InvalidArgument(
                f"output {alias!r} is a scalar: the row format ('instances') needs a batch dimension on every "
                f"output; ask in the columnar format ('inputs')"
            )
        if batch is not None and array.shape[0] != batch[1]:
            raise InvalidArgument(
                f"output {alias!r} has batch size {array.shape[0]}, expecting {batch[1]} as output {batch[0]!r}: "
                f"the row format needs one batch size; ask in the columnar format ('inputs')"
            )
        batch = batch or (alias, array.shape[0])
    if len(values) == 1:
        predictions = next(iter(values.values()))
    else:
        predictions = [{alias: value[i] for alias, value in values.items()} for i in range(batch[1])]
    return codec.dumps({"predictions": predictions}, all_finite)


# -- classify / regress -----------------------------------------------------------------------------------


async def classify_regress(
    rest: Rest, request: web.Request, verb: str, name: str, version: int | None, label: str
) -> web.Response:
    """The steps of server/protocols/tfserving/examples.py's Classify/Regress, with the costly ones (JSON ->
    tf.Examples -> their
    bytes, and results -> JSON: Python per example) on a worker thread when the body is large."""
    doc, size = await _document(rest, request)
    signature_name = doc.get("signature_name", "")
    serialized = await offload(size, serialized_examples, doc, threshold=EXAMPLES_OFFLOAD_BYTES)
    logged = request_logging.rest_examples(name, version, label, verb, doc, fill_input)  # None unless sampled
    del doc
    if verb == "classify":
        method, api = examples.CLASSIFY_METHOD, "Classification"
    else:
        method, api = examples.REGRESS_METHOD, "Regression"
    core = rest.core
    lease = core.lease(name, version, label)
    try:  # examples.classify/regress less their serialize and fill steps, which ran on the event loop
        served = lease.served
        sig = examples._lookup_signature(served, signature_name, f"{api}Request")
        where = examples.where_of(served.name, served.version, sig.name)
        plan = examples.plan_task(sig, method, where)
        values = await examples._run(core, lease, where, [plan], serialized)
    finally:
        lease.end()
    outputs = {alias: values[tensor] for alias, tensor in plan.outputs.items()}
    if logged is not None:
        logged(served, sig.name, outputs, len(serialized), where)
    text = await offload(size, encode_results, verb, outputs, len(serialized), where, threshold=EXAMPLES_OFFLOAD_BYTES)
    return json_response(text)


def serialized_examples(doc: dict) -> np.ndarray:
    """A classify/regress body's examples (and context) as the 1-D DT_STRING tensor of serialized tf.Examples
    that the signature is fed, built as TensorFlow Serving builds it."""
    proto = input_pb2.Input()
    fill_input(doc, proto)
    return examples.serialized_examples(proto, "the request's examples")


def encode_results(verb: str, outputs: dict[str, np.ndarray], count: int, where: str) -> bytes:
    """The ``{"results": [...]}`` answer of a classify (``[[label, score], ...]`` per example) or regress (one value
    per example) run, its outputs checked as the gRPC Classify/Regress check them."""
    if verb == "classify":
        result = classification_pb2.ClassificationResult()
        examples.fill_classification_result(result, outputs, count, where)
        results: Any = [  # the scores are float32: TensorFlow Serving's decimals for them
            [[c.label, codec.tf_decimal(c.score)] for c in cl.classes] for cl in result.classifications
        ]
        all_finite = all(math.isfinite(c[1]) for classes in results for c in classes)
    else:
        regression = regression_pb2.RegressionResult()
        examples.fill_regression_result(regression, outputs, count, where)
        results = np.array([r.value for r in regression.regressions], np.float32)
        all_finite = codec.finite(results)
        results = codec.tf_serving_floats(results)
    return codec.dumps({"results": results}, all_finite)


def fill_input(doc: dict, input_proto) -> None:
    """The ``context`` and ``examples`` of a classify/regress body into a tensorflow.serving.Input."""
    if "examples" not in doc:
        raise InvalidArgument(
            'key \'examples\' is expected and was not found: send {"examples": [{"feature": value, ...}, ...]}'
        )
    items = doc["examples"]
    if not isinstance(items, list):
        raise InvalidArgument(f"'examples' must be a list of objects, got {codec.type_name(items)}")
    if not items:
        raise InvalidArgument("'examples' value is an empty array: send at least one example")
    if "context" in doc:
        with_context = input_proto.example_list_with_context
        make_example(doc["context"], "context", with_context.context)
        target = with_context.examples
    else:
        target = input_proto.example_list.examples
    for i, item in enumerate(items):
        make_example(item, f"examples[{i}]", target.add())


def make_example(value: Any, where: str, example: example_pb2.Example) -> None:
    """A tf.Example from TensorFlow Serving's JSON form: feature name -> value or list of values; numbers with a
    fraction are floats, integers and booleans int64, strings and ``{"b64": ...}`` bytes."""
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be a JSON object (feature name -> values), got {codec.type_name(value)}")
    for name, content in value.items():
        feature = example.features.feature[name]
        for item in content if isinstance(content, list) else [content]:
            _add_value(feature, item, f"{where}[{name!r}]")


_KINDS = {"bytes_list": "bytes", "float_list": "float", "int64_list": "int64"}


def _add_value(feature: feature_pb2.Feature, value: Any, where: str) -> None:
    if isinstance(value, bool):
        kind, item = "int64_list", int(value)
    elif isinstance(value, int):
        if value > _INT64_MAX or value < -_INT64_MAX - 1:
            raise InvalidArgument(f"{where}: {value} does not fit int64, the only integer type of a tf.Example")
        kind, item = "int64_list", value
    elif isinstance(value, float):
        if abs(value) > _FLOAT32_MAX and np.isfinite(value):
            raise InvalidArgument(f"{where}: cannot convert {value} to float without loss of precision")
        kind, item = "float_list", value
    elif isinstance(value, str):
        kind, item = "bytes_list", value.encode()
    elif _is_b64(value):
        kind, item = "bytes_list", _b64decode(value["b64"], where, "feature")
    else:
        raise InvalidArgument(
            f"{where} has an element of unexpected JSON type {codec.type_name(value)} ({codec.show(value)}); expected "
            f'numbers, booleans, strings or {{"b64": ...}}'
        )
    have = feature.WhichOneof("kind")
    if have is not None and have != kind:
        raise InvalidArgument(
            f"{where}: unexpected element type {_KINDS[kind]} ({codec.show(value)}) in a feature of type "
            f"{_KINDS[have]}: a feature's values must all be of one type"
        )
    getattr(feature, kind).value.append(item)


# -- status / metadata ------------------------------------------------------------------------------------


async def model_status(rest: Rest, name: str, version: int | None, label: str) -> web.Response:
    response = model_status_response(rest.core.manager, name, version, label)
    return json_response(codec.dumps(json_format.MessageToDict(response, always_print_fields_with_no_presence=True)))


_METADATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # served version -> its answer


async def model_metadata(rest: Rest, name: str, version: int | None, label: str) -> web.Response:
    served = rest.core.resolve(name, version, label)
    body = _METADATA.get(served)
    if body is None:
        body = _METADATA[served] = metadata_json(served)
    return json_response(body)


def metadata_json(served) -> bytes:
    """TensorFlow Serving's metadata answer, built once per served version."""
    from tensorflow_serving.apis import get_model_metadata_pb2, model_pb2

    spec = model_pb2.ModelSpec(name=served.name)
    spec.version.value = served.version
    signatures = get_model_metadata_pb2.SignatureDefMap()
    for sig_name, sig in served.servable.model.meta_graph.signature_def.items():  # all, as gRPC's
        signatures.signature_def[sig_name].CopyFrom(sig)
    options = {"preserving_proto_field_name": True, "always_print_fields_with_no_presence": True}
    return codec.dumps(
        {
            "model_spec": json_format.MessageToDict(spec, **options),
            "metadata": {"signature_def": json_format.MessageToDict(signatures, **options)},
        }
    )
