"""A served model's configuration as Triton describes one (model_config.proto), for the clients that ask for it:
tritonclient's ``get_model_config`` over gRPC (``ModelConfig``) and REST (``GET /v2/models/{name}/config``).

Built from what servex serves, not read from a file: the platform (``tensorflow_savedmodel``), the version policy
of the model's config, the ``serving_default`` signature's inputs and outputs (none for a model without that
signature), and batching. As in Triton,
``max_batch_size`` > 0 means the 0th dimension is the batch and ``dims`` leave it out: servex says so when
batching is on for the model and every input and output has an unknown 0th dimension; otherwise
``max_batch_size`` is 0 and ``dims`` are the whole shapes (-1: any size; [-1] for a tensor of unknown rank).
The answer is a plain dict in Triton's JSON form (every field, numbers as numbers); the gRPC adapter parses it into
the message.
"""

from __future__ import annotations

from loader.config import VersionPolicy
from server import v2_types
from server.core import DEFAULT_SIGNATURE, ServingCore

PLATFORM = "tensorflow_savedmodel"


def model_config(core: ServingCore, name: str, version: int | None) -> dict:
    served = core.resolve(name, version)
    # A model without serving_default (what a v2 call runs unless it names another signature) serves all the
    # same: it is described with no inputs or outputs, as its metadata is.
    sig = served.servable.model.signatures.get(DEFAULT_SIGNATURE)
    handler = core.run_handler
    # The version's own batching parameters (batching_params.pbtxt) when batching is on and it has them.
    batching = handler.batching and (getattr(served.servable, "batching", None) or handler.batching)
    inputs = sorted(sig.inputs.items()) if sig is not None else []
    outputs = [(alias, sig.outputs[alias]) for alias in sig.output_aliases] if sig is not None else []
    batched = (
        sig is not None
        and batching is not None
        and all(
            spec.shape is not None and len(spec.shape) > 0 and spec.shape[0] is None for _, spec in inputs + outputs
        )
    )
    config = {
        "name": served.name,
        "platform": PLATFORM,
        "backend": "tensorflow",
        "version_policy": _policy(core.manager.spec(served.name).policy),
        "max_batch_size": batching.max_batch_size if batched else 0,
        "input": [
            {
                "name": alias,
                "data_type": _data_type(spec.dtype),
                "format": "FORMAT_NONE",
                "dims": _dims(spec.shape, batched),
                "is_shape_tensor": False,
                "allow_ragged_batch": False,
                "optional": False,
            }
            for alias, spec in inputs
        ],
        "output": [
            {
                "name": alias,
                "data_type": _data_type(spec.dtype),
                "dims": _dims(spec.shape, batched),
                "label_filename": "",
                "is_shape_tensor": False,
            }
            for alias, spec in outputs
        ],
    }
    if batched:  # a free worker never waits for a batch to fill: no queue delay
        config["dynamic_batching"] = {
            "preferred_batch_size": list(batching.allowed_batch_sizes),
            "max_queue_delay_microseconds": 0,
        }
    return config


def _policy(policy: VersionPolicy) -> dict:
    if policy.kind == "all":
        return {"all": {}}
    if policy.kind == "specific":
        return {"specific": {"versions": sorted(policy.versions)}}
    return {"latest": {"num_versions": policy.num_versions}}


def _data_type(dtype) -> str:
    try:
        name = v2_types.datatype(dtype)
    except ValueError:  # no v2 datatype (complex, ...): Triton's own word for it
        return "TYPE_INVALID"
    return "TYPE_STRING" if name == v2_types.BYTES else f"TYPE_{name}"


def _dims(shape, batched: bool) -> list[int]:
    if shape is None:
        return [-1]
    dims = [-1 if d is None else int(d) for d in shape]
    return dims[1:] if batched else dims
