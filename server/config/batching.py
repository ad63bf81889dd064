"""TensorFlow Serving's BatchingParameters read as servex applies them: the server's (``--batching_parameters_file``,
or the platform config's ``batching_parameters``) and a version's own (``batching_params.pbtxt`` with
``--enable_per_model_batching_params``). Fields servex reads but does not apply are logged with the reason."""

from __future__ import annotations

import logging
from pathlib import Path

from google.protobuf import text_format

from servex.executor.batching import BatchingOptions
from servex.loader.errors import InvalidArgument
from servex.protos.servex.v1 import batching_pb2
from servex.server.config.settings import ServerSettings

log = logging.getLogger("servex")


def batching_options(settings: ServerSettings) -> BatchingOptions | None:
    """The server's batching settings, from TensorFlow Serving's BatchingParameters file or platform config file
    when one is given; servex's automatic batching when batching is not asked for (and not turned off)."""
    if not settings.enable_batching:
        return (
            BatchingOptions(max_batch_size=settings.auto_max_batch_size, auto=True) if settings.auto_batching else None
        )
    path = settings.batching_parameters_file
    if path:
        return parse_batching_parameters(Path(path).read_text(encoding="utf-8"), f"batching parameters file {path!r}")
    if settings.platform_config_file:
        where = f"the batching_parameters of platform config file {settings.platform_config_file!r}"
        return parse_batching_parameters(settings.batching_parameters, where)
    return BatchingOptions()


# BatchingParameters' fields that servex reads but does not apply, each one set logged with the reason.
BATCHING_NO_EFFECT = {
    "batch_timeout_micros": "a batch runs as soon as a run worker is free, never waiting to fill (batching adds no "
    "latency at low load; under load batches form from what queued while the workers were busy)",
    "num_batch_threads": "--num_run_workers sets the threads that run batches, for every model",
    "max_enqueued_batches": "--max_queued_requests bounds each model's queue (and --max_queued_bytes its inputs)",
    "thread_pool_name": "every model's runs share servex's one RunHandler",
    "enable_large_batch_splitting": "a request of more rows than max_batch_size runs on its own, unsplit",
    "max_execution_batch_size": "a request of more rows than max_batch_size runs on its own, unsplit",
}


def parse_batching_parameters(text: str, where: str) -> BatchingOptions:
    """BatchingParameters in text format (TensorFlow Serving's); InvalidArgument names ``where`` and the problem."""
    params = batching_pb2.BatchingParameters()
    try:
        text_format.Parse(text, params)
    except text_format.ParseError as e:
        raise InvalidArgument(f"{where} is not BatchingParameters in text format: {e}") from e
    size = params.max_batch_size.value if params.HasField("max_batch_size") else BatchingOptions.max_batch_size
    allowed = tuple(params.allowed_batch_sizes)
    if size < 1:
        raise InvalidArgument(f"{where}: max_batch_size must be at least 1, got {size}")
    if allowed and (list(allowed) != sorted(set(allowed)) or allowed[-1] != size or allowed[0] < 1):
        raise InvalidArgument(
            f"{where}: allowed_batch_sizes {list(allowed)} must increase and end with max_batch_size {size}"
        )
    for field, _value in params.ListFields():
        if field.name in BATCHING_NO_EFFECT:
            log.warning("%s: %s has no effect in servex: %s", where, field.name, BATCHING_NO_EFFECT[field.name])
    return BatchingOptions(max_batch_size=size, allowed_batch_sizes=allowed,
                           pad_variable_length_inputs=params.pad_variable_length_inputs)  # fmt: skip


PER_MODEL_BATCHING_FILE = "batching_params.pbtxt"  # TensorFlow Serving's name, inside the version folder


def per_model_batching(settings: ServerSettings, path: str) -> BatchingOptions | None:
    """A version's own batching parameters (``--enable_per_model_batching_params``), or None."""
    if not (settings.enable_batching and settings.enable_per_model_batching_params):
        return None
    file = Path(path) / PER_MODEL_BATCHING_FILE
    if not file.is_file():
        return None
    return parse_batching_parameters(file.read_text(encoding="utf-8"), f"per-model batching parameters {str(file)!r}")
