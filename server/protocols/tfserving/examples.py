"""TensorFlow Serving's Classify, Regress and MultiInference over the ServingCore: tf.Examples in, results out.

What TensorFlow Serving does (tensorflow_serving/servables/tensorflow/classifier.cc, regressor.cc,
multi_inference.cc, util.cc), and so what this does:

- The request's ``Input`` becomes one 1-D DT_STRING tensor of serialized tf.Examples (``serialized_examples``).
  With ``example_list_with_context`` each entry is the context's bytes followed by the example's bytes: parsed,
  that is the context merged with the example, whose features override the context's features of the same name.
- The signature (``model_spec.signature_name``, default ``serving_default``) must have exactly one input, aliased
  ``inputs``, which is fed that tensor. Classify needs one or two outputs, among them ``classes`` (DT_STRING
  ``[batch, k]``) and/or ``scores`` (DT_FLOAT ``[batch, k]``); Regress needs exactly one, ``outputs`` (DT_FLOAT
  ``[batch]`` or ``[batch, 1]``). Every output must have one row per example.
- The signature's ``method_name`` is checked only when asked (``check_method_name``; TensorFlow Serving's
  ``--enable_signature_method_name_check``, off by default), because TF2's ``tf.saved_model.save`` writes
  ``tensorflow/serving/predict`` for every signature: by default any signature of the right shape serves.
- MultiInference: every task names the same model (the version comes from the first task), each signature at most
  once, and each task's method is classify or regress. All tasks run in ONE run: the examples feed every task's
  input tensor (one tensor when the signatures share it, as TF1 exports do; one per signature in TF2 exports, which
  current TensorFlow Serving accepts too), shared output tensors are fetched once, and results come back in task
  order.
- Errors are INVALID_ARGUMENT (an unknown signature too, where Predict says FAILED_PRECONDITION), UNIMPLEMENTED
  for a task method other than classify or regress, and NOT_FOUND/UNAVAILABLE for the model as for Predict.

Unlike ``ServingCore.predict``, the signature's declared input dtype is not checked (TensorFlow Serving feeds by
tensor name, and its own half_plus_three test model declares its serialized-example input DT_FLOAT); the graph
still checks the fed tensor against its placeholder. The run goes through the core's RunHandler on the version's
GraphExecutor under one lease, so the signature checked is the signature run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import classification_pb2, inference_pb2, input_pb2, regression_pb2

from servex.loader.errors import InvalidArgument, ServingError, Unimplemented
from servex.loader.saved_model import Signature, dtype_name
from servex.server.core import DEFAULT_SIGNATURE, ServingCore
from servex.server.transport import tensors
from servex.server.transport.rpc import spec_version

CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"
# Aliases TensorFlow's signature_constants fix for these methods.
INPUTS = "inputs"
CLASSES = "classes"
SCORES = "scores"
OUTPUTS = "outputs"


@dataclass(frozen=True)
class Plan:
    """What one signature run needs: the tensor the examples feed, and output alias -> tensor name."""

    signature: Signature
    method: str
    input_name: str
    outputs: dict[str, str]


# -- input --------------------------------------------------------------------------------------------------


LARGE = 2048  # examples: past this, serializing them and filling their results run off the event loop


async def off_loop(count: int, fn, *args):
    """``fn(*args)``, on a worker thread when ``count`` examples would hold the event loop (about 1 us each to
    serialize, more to answer: millions of them would stall every other caller for seconds)."""
    return await tensors.off_loop(count, fn, *args, threshold=LARGE)


def example_count(input_proto: input_pb2.Input) -> int:
    kind = input_proto.WhichOneof("kind")
    return len(getattr(input_proto, kind).examples) if kind else 0


def serialized_examples(input_proto: input_pb2.Input, where: str) -> np.ndarray:
    """The examples of a tensorflow.serving.Input as a 1-D object array of serialized tf.Example bytes.

    ``where`` names the field in error messages (``"ClassificationRequest.input"``). With a context, each entry
    is ``context bytes + example bytes`` exactly as TensorFlow Serving builds it, which parses as the example
    merged over the context (the example's features win).
    """
    kind = input_proto.WhichOneof("kind")
    if kind == "example_list":
        data = [e.SerializeToString() for e in input_proto.example_list.examples]
    elif kind == "example_list_with_context":
        with_context = input_proto.example_list_with_context
        context = with_context.context.SerializeToString()
        data = [context + e.SerializeToString() for e in with_context.examples]
    else:
        raise InvalidArgument(
            f"{where} is empty: set example_list or example_list_with_context to the tf.Examples to run on"
        )
    if not data:
        raise InvalidArgument(f"{where} is empty: its {kind} holds no tf.Example (examples is empty)")
    examples = np.empty(len(data), dtype=object)
    examples[:] = data
    return examples


# -- signature checks ---------------------------------------------------------------------------------------


def where_of(name: str, version: int, signature_name: str) -> str:
    return f"model {name!r} version {version} signature {signature_name!r}"


def _describe(specs: Mapping) -> str:
    return ", ".join(f"{a} ({s.describe()})" for a, s in sorted(specs.items())) or "none"


def plan_task(sig: Signature, method: str, where: str, check_method_name: bool = False) -> Plan:
    """Check ``sig`` serves ``method`` (classify or regress) as TensorFlow Serving's PreProcessClassification /
    PreProcessRegression do; InvalidArgument naming what the signature has and what was expected."""
    api = "Classify" if method == CLASSIFY_METHOD else "Regress"
    if check_method_name and sig.method_name != method:
        raise InvalidArgument(
            f"{where}: {api} needs a signature with method_name {method!r}, this one has {sig.method_name!r}"
        )
    if len(sig.inputs) != 1 or INPUTS not in sig.inputs:
        raise InvalidArgument(
            f"{where}: {api} needs a signature with exactly one input, {INPUTS!r} (the serialized tf.Examples); "
            f"the signature's inputs are: {_describe(sig.inputs)}"
        )
    if method == CLASSIFY_METHOD:
        wanted = [a for a in (CLASSES, SCORES) if a in sig.outputs]
        if len(sig.outputs) not in (1, 2) or not wanted:
            raise InvalidArgument(
                f"{where}: Classify needs a signature with one or two outputs, among them {CLASSES!r} "
                f"(DT_STRING [batch, k]) and/or {SCORES!r} (DT_FLOAT [batch, k]); "
                f"the signature's outputs are: {_describe(sig.outputs)}"
            )
    else:
        wanted = [OUTPUTS]
        if len(sig.outputs) != 1 or OUTPUTS not in sig.outputs:
            raise InvalidArgument(
                f"{where}: Regress needs a signature with exactly one output, {OUTPUTS!r} (DT_FLOAT [batch] or "
                f"[batch, 1]); the signature's outputs are: {_describe(sig.outputs)}"
            )
    return Plan(sig, method, sig.inputs[INPUTS].name, {a: sig.outputs[a].name for a in wanted})


def _lookup_signature(served, signature_name: str, what: str) -> Signature:
    """The signature ``signature_name`` (default serving_default); INVALID_ARGUMENT when missing, as
    TensorFlow Serving's classify, regress and multi-inference answer."""
    name = signature_name or DEFAULT_SIGNATURE
    signatures = served.servable.model.signatures
    sig = signatures.get(name)
    if sig is None:
        raise InvalidArgument(
            f"{what}: model {served.name!r} version {served.version} has no signature {name!r}; "
            f"available signatures: {', '.join(sorted(signatures)) or 'none'}"
        )
    return sig


# -- results ------------------------------------------------------------------------------------------------


def _shape(value: np.ndarray) -> list[int]:
    return list(value.shape)


def _check_batch(where: str, alias: str, value: np.ndarray, num_examples: int) -> None:
    if value.shape[0] != num_examples:
        raise InvalidArgument(
            f"{where}: output {alias!r} has batch size {value.shape[0]} (shape {_shape(value)}), "
            f"but the request has {num_examples} example(s)"
        )


def fill_classification_result(
    result: classification_pb2.ClassificationResult,
    outputs: Mapping[str, np.ndarray],
    num_examples: int,
    where: str,
) -> None:
    """Fill ``result`` from the ``classes`` and/or ``scores`` outputs (as PostProcessClassificationResult):
    one Classifications per example, one Class per column, with a label, a score or both."""
    classes = outputs.get(CLASSES)
    scores = outputs.get(SCORES)
    if classes is None and scores is None:
        raise InvalidArgument(f"{where}: no {CLASSES!r} or {SCORES!r} output to classify with")
    for alias, value, expected in ((CLASSES, classes, "DT_STRING"), (SCORES, scores, "DT_FLOAT")):
        if value is None:
            continue
        if value.ndim != 2:
            raise InvalidArgument(
                f"{where}: output {alias!r} must have shape [batch_size, num_classes], got {_shape(value)}"
            )
        if dtype_name(value.dtype) != expected:
            raise InvalidArgument(f"{where}: output {alias!r} must be {expected}, got {dtype_name(value.dtype)}")
        _check_batch(where, alias, value, num_examples)
    if classes is not None and scores is not None and classes.shape[1] != scores.shape[1]:
        raise InvalidArgument(
            f"{where}: outputs {CLASSES!r} {_shape(classes)} and {SCORES!r} {_shape(scores)} "
            f"disagree on the number of classes"
        )
    labels = classes.tolist() if classes is not None else None
    values = scores.tolist() if scores is not None else None
    num_classes = (classes if classes is not None else scores).shape[1]
    for i in range(num_examples):
        add = result.classifications.add().classes.add
        for c in range(num_classes):
            cls = add()
            if labels is not None:
                label = labels[i][c]
                try:
                    cls.label = label.decode() if isinstance(label, bytes) else label
                except UnicodeDecodeError as e:
                    raise InvalidArgument(
                        f"{where}: output {CLASSES!r} [{i}, {c}] is not UTF-8 text ({label[:32]!r}); "
                        f"Class.label is a string"
                    ) from e
            if values is not None:
                cls.score = values[i][c]


def fill_regression_result(
    result: regression_pb2.RegressionResult, outputs: Mapping[str, np.ndarray], num_examples: int, where: str
) -> None:
    """Fill ``result`` from the ``outputs`` output (as PostProcessRegressionResult): one value per example."""
    value = outputs.get(OUTPUTS)
    if value is None:
        raise InvalidArgument(f"{where}: no {OUTPUTS!r} output to regress with")
    if not (value.ndim == 1 or (value.ndim == 2 and value.shape[1] == 1)):
        raise InvalidArgument(
            f"{where}: output {OUTPUTS!r} must have shape [batch_size] or [batch_size, 1], got {_shape(value)}"
        )
    _check_batch(where, OUTPUTS, value, num_examples)
    if value.dtype != np.float32:
        raise InvalidArgument(f"{where}: output {OUTPUTS!r} must be DT_FLOAT, got {dtype_name(value.dtype)}")
    add = result.regressions.add
    for v in value.ravel().tolist():
        add().value = v


def _fill(result, plan: Plan, values_by_tensor: Mapping[str, np.ndarray], num_examples: int, where: str) -> None:
    outputs = {alias: values_by_tensor[tensor] for alias, tensor in plan.outputs.items()}
    if plan.method == CLASSIFY_METHOD:
        fill_classification_result(result, outputs, num_examples, where)
    else:
        fill_regression_result(result, outputs, num_examples, where)


# -- runs ---------------------------------------------------------------------------------------------------


def _lease(core: ServingCore, spec, field: str = "model_spec"):
    if not spec.name:
        raise InvalidArgument(f"{field}.name is empty: name the model to call")
    return core.lease(spec.name, spec_version(spec), spec.version_label)


async def _run(core: ServingCore, lease, where: str, plans: Sequence[Plan], examples: np.ndarray) -> dict:
    """One run of the leased version: the examples feed every plan's input tensor, and every plan's
    output tensors are fetched once. Returns tensor name -> value. Errors keep their code and say which model and
    signature(s) they came from."""
    inputs = sorted({plan.input_name for plan in plans})
    fetches = sorted({tensor for plan in plans for tensor in plan.outputs.values()})
    try:
        signatures = ",".join(sorted({plan.signature.name for plan in plans}))
        values = await core.run_signature_tensors(lease, dict.fromkeys(inputs, examples), fetches, signatures)
    except ServingError as e:
        hint = _input_hint(plans) if "dtype" in e.message else ""
        error = ServingError(f"{where}: {e.message}{hint}")
        error.code = e.code
        raise error from e
    return dict(zip(fetches, values, strict=True))


def _input_hint(plans: Sequence[Plan]) -> str:
    """For a run that failed on a dtype: the signatures whose ``inputs`` is not declared DT_STRING."""
    odd = [p for p in plans if p.signature.inputs[INPUTS].dtype_enum != types_pb2.DT_STRING]
    if not odd:
        return ""
    declared = "; ".join(
        f"signature {p.signature.name!r} declares {p.signature.inputs[INPUTS].describe()}" for p in odd
    )
    return f" (the serialized tf.Examples are fed to input {INPUTS!r} as DT_STRING; {declared})"


async def _single(core: ServingCore, request, method: str, api: str, check_method_name: bool):
    spec = request.model_spec
    lease = _lease(core, spec)
    served = lease.served
    try:
        sig = _lookup_signature(served, spec.signature_name, f"{api}Request")
        where = where_of(served.name, served.version, sig.name)
        plan = plan_task(sig, method, where, check_method_name)
        count = example_count(request.input)
        examples = await off_loop(count, serialized_examples, request.input, f"{api}Request.input")
        values = await _run(core, lease, where, [plan], examples)
    finally:
        lease.end()
    return served, plan, values, len(examples), where


def _fill_model_spec(model_spec, served, signature_name: str) -> None:
    model_spec.name = served.name
    model_spec.version.value = served.version
    model_spec.signature_name = signature_name


async def classify(
    core: ServingCore, request: classification_pb2.ClassificationRequest, *, check_method_name: bool = False
) -> classification_pb2.ClassificationResponse:
    """PredictionService.Classify."""
    served, plan, values, n, where = await _single(core, request, CLASSIFY_METHOD, "Classification", check_method_name)
    response = classification_pb2.ClassificationResponse()
    _fill_model_spec(response.model_spec, served, plan.signature.name)
    await off_loop(n, _fill, response.result, plan, values, n, where)
    return response


async def regress(
    core: ServingCore, request: regression_pb2.RegressionRequest, *, check_method_name: bool = False
) -> regression_pb2.RegressionResponse:
    """PredictionService.Regress."""
    served, plan, values, n, where = await _single(core, request, REGRESS_METHOD, "Regression", check_method_name)
    response = regression_pb2.RegressionResponse()
    _fill_model_spec(response.model_spec, served, plan.signature.name)
    await off_loop(n, _fill, response.result, plan, values, n, where)
    return response


def _version_of(spec) -> str:
    """How a ModelSpec names its version, for comparing tasks: a number, a label, or the latest."""
    which = spec.WhichOneof("version_choice")
    if which == "version":
        return f"version {spec.version.value}"
    if which == "version_label":
        return f"version_label {spec.version_label!r}"
    return "the latest version"


async def multi_inference(
    core: ServingCore, request: inference_pb2.MultiInferenceRequest, *, check_method_name: bool = False
) -> inference_pb2.MultiInferenceResponse:
    """PredictionService.MultiInference: every task's signature over the same examples, in one run."""
    tasks = request.tasks
    if not tasks:
        raise InvalidArgument("MultiInferenceRequest.tasks is empty: add a classify or regress task")
    first = tasks[0].model_spec
    lease = _lease(core, first, "tasks[0].model_spec")
    served = lease.served
    try:
        plans: list[Plan] = []
        seen: dict[str, int] = {}  # signature name -> the task that names it
        for i, task in enumerate(tasks):
            spec = task.model_spec
            if not spec.name:
                raise InvalidArgument(f"tasks[{i}].model_spec.name is empty: every task names the model")
            if spec.name != first.name:
                raise InvalidArgument(
                    f"all tasks of a MultiInferenceRequest must name the same model: tasks[0] names "
                    f"{first.name!r}, tasks[{i}] names {spec.name!r}"
                )
            if _version_of(spec) != _version_of(first):
                raise InvalidArgument(
                    f"all tasks of a MultiInferenceRequest run one version of the model: tasks[0] names "
                    f"{_version_of(first)}, tasks[{i}] names {_version_of(spec)}"
                )
            signature_name = spec.signature_name or DEFAULT_SIGNATURE
            if signature_name in seen:
                raise InvalidArgument(
                    f"tasks[{i}] evaluates signature {signature_name!r} again (tasks[{seen[signature_name]}] does "
                    f"already): each signature may appear once"
                )
            seen[signature_name] = i
            sig = _lookup_signature(served, signature_name, f"MultiInferenceRequest tasks[{i}]")
            if task.method_name not in (CLASSIFY_METHOD, REGRESS_METHOD):
                raise Unimplemented(
                    f"tasks[{i}].method_name {task.method_name!r} is not supported: use {CLASSIFY_METHOD!r} "
                    f"or {REGRESS_METHOD!r}"
                )
            plans.append(
                plan_task(sig, task.method_name, where_of(served.name, served.version, sig.name), check_method_name)
            )
        examples = await off_loop(
            example_count(request.input), serialized_examples, request.input, "MultiInferenceRequest.input"
        )
        run_where = f"model {served.name!r} version {served.version} signatures {[p.signature.name for p in plans]}"
        by_tensor = await _run(core, lease, run_where, plans, examples)
    finally:
        lease.end()
    response = inference_pb2.MultiInferenceResponse()
    for plan in plans:
        result = response.results.add()
        _fill_model_spec(result.model_spec, served, plan.signature.name)
        target = result.classification_result if plan.method == CLASSIFY_METHOD else result.regression_result
        where = where_of(served.name, served.version, plan.signature.name)
        await off_loop(len(examples), _fill, target, plan, by_tensor, len(examples), where)
    return response
