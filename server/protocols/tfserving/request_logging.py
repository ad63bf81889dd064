"""TensorFlow Serving's request logging on its APIs: the calls of a model with a ``logging_config`` become
PredictionLog records (server/observability/request_log.py samples, queues and writes them).

- gRPC: Predict, Classify, Regress, MultiInference and SessionRun (``logged``): the request as received and the
  response as answered, the very messages, handed to the writer (neither changes after the answer).
- REST: ``:predict``, ``:classify`` and ``:regress``, logged as TensorFlow Serving logs them, its REST handler
  turning the JSON into the gRPC request it then runs: a PredictRequest (the inputs as decoded, in typed
  fields) or a Classification/RegressionRequest (the JSON's examples and context as tf.Examples), and the
  response the gRPC call would answer. They are built by the writer thread from what the handler decoded and
  the run answered, only for the calls sampled.

Only answered calls are logged. A model without a logging_config costs a call nothing but a look in an empty
dict (no model logs) or a dict lookup.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from tensorflow_serving.apis import classification_pb2, predict_pb2, regression_pb2

from servex.server.observability.request_log import LOGS
from servex.server.protocols.tfserving import examples
from servex.server.transport.rpc import model_name
from servex.server.transport.tensors import fill_proto


def logged(kind: str):
    """A gRPC method whose answered calls are logged as ``kind`` records (``predict_log``, ...) when their model
    has a logging_config (and the call is sampled)."""

    def wrap(method):
        @functools.wraps(method)
        async def wrapper(self, request, context):
            response = await method(self, request, context)
            loggers = LOGS.by_model
            if loggers:
                name = model_name(request)
                logger = loggers.get(name)
                if logger is not None:
                    logger.log(name, kind, request, response)
            return response

        return wrapper

    return wrap


def _sampled(name: str):
    """The logger of model ``name`` when it logs and samples this call; else None."""
    loggers = LOGS.by_model
    if not loggers:
        return None
    logger = loggers.get(name)
    return logger if logger is not None and logger.sample() else None


def _request_spec(model_spec, name: str, version: int | None, label: str, signature_name: str) -> None:
    """The ModelSpec of a REST call's request, as TensorFlow Serving's REST handler fills it from the URL and body."""
    model_spec.name = name
    if version is not None:
        model_spec.version.value = version
    elif label:
        model_spec.version_label = label
    model_spec.signature_name = signature_name


def _answer_spec(model_spec, name: str, version: int, signature_name: str) -> None:
    model_spec.name = name
    model_spec.version.value = version
    model_spec.signature_name = signature_name


def rest_predict(name: str, version: int | None, label: str, signature_name: str, inputs: dict, result) -> None:
    """Log a REST predict call of model ``name`` (if sampled): ``inputs`` as decoded by alias, ``result`` the
    core's PredictResult. Neither may change after."""
    logger = _sampled(name)
    if logger is not None:
        build = functools.partial(_predict_messages, name, version, label, signature_name, inputs, result)
        logger.submit(name, "predict_log", build)


def _predict_messages(name, version, label, signature_name, inputs, result):
    request = predict_pb2.PredictRequest()
    _request_spec(request.model_spec, name, version, label, signature_name)
    for alias, array in inputs.items():
        fill_proto(request.inputs[alias], array)
    response = predict_pb2.PredictResponse()
    _answer_spec(response.model_spec, result.model_name, result.version, result.signature_name)
    for alias, array in result.outputs.items():
        fill_proto(response.outputs[alias], array)
    return request, response


def rest_examples(
    name: str, version: int | None, label: str, verb: str, doc: dict, fill_input: Callable
) -> Callable | None:
    """For a REST classify or regress call (``verb``) of model ``name``: None unless it is sampled; else the
    function to call with its run's outcome, ``(served, signature name, outputs by alias, example count, where)``,
    to log it. ``doc`` is the parsed body, which ``fill_input`` (the REST API's) turns into the request's Input
    on the writer thread: nothing may change it after."""
    logger = _sampled(name)
    if logger is None:
        return None
    kind = "classify_log" if verb == "classify" else "regress_log"

    def record(served, signature_name: str, outputs: dict, count: int, where: str) -> None:
        answer = (served.name, served.version, signature_name, outputs, count, where)
        build = functools.partial(_examples_messages, verb, (name, version, label), doc, fill_input, answer)
        logger.submit(name, kind, build)

    return record


def _examples_messages(verb: str, called: tuple, doc: dict, fill_input: Callable, answer: tuple):
    served_name, served_version, signature_name, outputs, count, where = answer
    if verb == "classify":
        request, response = classification_pb2.ClassificationRequest(), classification_pb2.ClassificationResponse()
        examples.fill_classification_result(response.result, outputs, count, where)
    else:
        request, response = regression_pb2.RegressionRequest(), regression_pb2.RegressionResponse()
        examples.fill_regression_result(response.result, outputs, count, where)
    _request_spec(request.model_spec, *called, doc.get("signature_name", ""))
    fill_input(doc, request.input)
    _answer_spec(response.model_spec, served_name, served_version, signature_name)
    return request, response
