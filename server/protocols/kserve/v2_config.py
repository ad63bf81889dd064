"""A served model's configuration as Triton describes one (model_config.proto), for the clients that ask for it:
tritonclient's ``get_model_config`` over gRPC (``ModelConfig``) and REST (``GET /v2/models/{name}/config``).

A model of a Triton model repository (``--model-repository``) answers with its config.pbtxt, completed from the
SavedModel as Triton's auto-complete does (``completed_config``), and the file is checked against the SavedModel when a
version loads (``check_config``); its ``dynamic_batching`` turns batching on for it (``batching``).

Other models' configurations are built from what servex serves: the platform (``tensorflow_savedmodel``), the
version policy of the model's config, the ``serving_default`` signature's inputs and outputs (none for a model
without that signature), and batching. As in Triton,
``max_batch_size`` > 0 means the 0th dimension is the batch and ``dims`` leave it out: servex says so when
batching is on for the model and every input and output has an unknown 0th dimension; otherwise
``max_batch_size`` is 0 and ``dims`` are the whole shapes (-1: any size; [-1] for a tensor of unknown rank).
The answer is a plain dict in Triton's JSON form (every field, numbers as numbers); the gRPC adapter parses it into
the message.
"""

from __future__ import annotations

import dataclasses

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor

from servex.executor.batching import NO_BATCHING, BatchingOptions
from servex.loader.config import VersionPolicy
from servex.loader.errors import LoadError
from servex.loader.model_repository import BACKEND, DEFAULT_MODEL_FILENAME, PLATFORM
from servex.server.core import DEFAULT_SIGNATURE, ServingCore
from servex.server.protocols.kserve import v2_types


def model_config(core: ServingCore, name: str, version: int | None) -> dict:
    served = core.resolve(name, version)
    # A model without serving_default (what a v2 call runs unless it names another signature) serves all the
    # same: it is described with no inputs or outputs, as its metadata is.
    sig = served.servable.model.signatures.get(DEFAULT_SIGNATURE)
    effective = getattr(served.servable, "model_config", None)  # a Triton repository model's, made at load
    if effective is not None:
        return as_dict(effective)
    handler = core.run_handler
    batching = handler.batching_for(served.servable)
    inputs = sorted(sig.inputs.items()) if sig is not None else []
    outputs = [(alias, sig.outputs[alias]) for alias in sig.output_aliases] if sig is not None else []
    batched = (
        sig is not None
        and batching is not None
        and not batching.auto  # servex's own choice, unseen by clients: shapes stay whole, as without batching
        and all(
            spec.shape is not None and len(spec.shape) > 0 and spec.shape[0] is None for _, spec in inputs + outputs
        )
    )
    config = {
        "name": served.name,
        "platform": PLATFORM,
        "backend": BACKEND,
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


# -- a Triton model repository's config.pbtxt ---------------------------------------------------------------------


def load_config(name: str, config, model, auto_complete: bool = True, default_max_batch_size: int = 4):
    """A repository model version's effective config, made when it loads: its config.pbtxt checked against the
    SavedModel (``check_config``) and completed from it (``completed_config``); the model's signature then follows
    it (``narrow_signature``). LoadError where they disagree."""
    sig = model.signatures.get(DEFAULT_SIGNATURE)
    effective = completed_config(config, name, sig, auto_complete, default_max_batch_size)
    check_config(name, config, effective.max_batch_size, sig)
    narrow_signature(model, config, effective.max_batch_size)
    return effective


def completed_config(config, name: str, sig, auto_complete: bool = True, default_max_batch_size: int = 4):
    """A copy of a repository model's config.pbtxt completed as Triton's auto-complete completes it: name, platform,
    backend, default model file and version policy where left out; with ``auto_complete``, a ``max_batch_size`` of
    ``default_max_batch_size`` where the file gives none and the SavedModel batches (every input and output has an
    unknown 0th dimension, and the dims the file lists leave it out), with dynamic batching where that is more than
    1 and the file names no scheduler (Triton's TensorFlow backend, ``--backend-config=default-max-batch-size``);
    the signature's inputs that it does not list, and its outputs when it lists none (dims after the batch dimension
    when max_batch_size > 0)."""
    answer = type(config)()
    answer.CopyFrom(config)
    answer.name = name
    answer.platform = PLATFORM
    answer.backend = BACKEND
    answer.default_model_filename = answer.default_model_filename or DEFAULT_MODEL_FILENAME
    if not answer.HasField("version_policy"):
        answer.version_policy.latest.num_versions = 1
    if sig is None:
        return answer
    if auto_complete and answer.max_batch_size == 0 and default_max_batch_size > 0 and _batches(config, sig):
        answer.max_batch_size = default_max_batch_size
        if default_max_batch_size > 1 and answer.WhichOneof("scheduling_choice") is None:
            answer.dynamic_batching.SetInParent()
    data_types = answer.DESCRIPTOR.file.enum_types_by_name["DataType"]
    batched = answer.max_batch_size > 0
    listed = {tensor.name for tensor in answer.input}
    for alias, spec in sorted(sig.inputs.items()):
        if alias not in listed:
            added = answer.input.add(name=alias, dims=_dims(spec.shape, batched))
            added.data_type = data_types.values_by_name[_data_type(spec.dtype)].number
    for alias in sig.output_aliases if not answer.output else ():  # a file listing outputs names them all
        spec = sig.outputs[alias]
        added = answer.output.add(name=alias, dims=_dims(spec.shape, batched))
        added.data_type = data_types.values_by_name[_data_type(spec.dtype)].number
    return answer


def _batches(config, sig) -> bool:
    """Whether a SavedModel batches as Triton's TensorFlow backend infers it for a config without
    max_batch_size: every input and output has an unknown 0th dimension, and the dims the config lists (if any)
    leave that dimension out."""
    listed = {t.name: len(t.dims) for t in [*config.input, *config.output]}
    for alias, spec in [*sig.inputs.items(), *sig.outputs.items()]:
        if spec.shape is None or not spec.shape or spec.shape[0] is not None:
            return False
        if alias in listed and listed[alias] != len(spec.shape) - 1:
            return False
    return True


def as_dict(config) -> dict:
    """A ModelConfig in Triton's JSON form: every field, 64-bit integers as numbers."""
    plain = json_format.MessageToDict(
        config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(config.DESCRIPTOR, plain)


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}  # fmt: skip


def _numbers(descriptor, plain: dict) -> dict:
    """``plain`` (json_format's dict of a ``descriptor`` message) with its 64-bit integers as numbers, as Triton
    writes them (json_format writes them as strings)."""
    for key, value in plain.items():
        field = descriptor.fields_by_name.get(key)
        if field is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is not None:
                for item in value.values():
                    _numbers(value_field.message_type, item)
        elif field.message_type is not None:
            for item in value if isinstance(value, list) else [value]:
                _numbers(field.message_type, item)
        elif field.type in _INT64:
            plain[key] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return plain


def check_config(name: str, config, max_batch_size: int, sig) -> None:
    """LoadError when a repository model's config.pbtxt does not describe its SavedModel's ``serving_default``
    signature, as Triton's TensorFlow backend checks it at load: the inputs it lists must be all those the
    signature needs (those without a default); each input and output it lists must be one of the signature's, of
    the same data type, with dims -1 or at least 1 that the signature's shape takes (an input may fix a size the
    SavedModel leaves open; an output's dims must be the SavedModel's exactly, -1 where it has none), after the
    batch dimension when ``max_batch_size`` (the file's, or auto-complete's) is above 0, and then every input and
    every listed output must have an unknown 0th dimension."""
    where = f"model {name!r}: config.pbtxt"
    if sig is None:
        if config.input or config.output:
            raise LoadError(f"{where} lists inputs or outputs, but the SavedModel has no {DEFAULT_SIGNATURE!r} "
                            f"signature")  # fmt: skip
        return
    data_types = config.DESCRIPTOR.file.enum_types_by_name["DataType"]
    batched = max_batch_size > 0
    for kind, listed, tensors in (("input", config.input, sig.inputs), ("output", config.output, sig.outputs)):
        for tensor in listed:
            spec = tensors.get(tensor.name)
            if spec is None:
                raise LoadError(
                    f"{where}: {kind} {tensor.name!r} is not an {kind} of the SavedModel's {DEFAULT_SIGNATURE!r} "
                    f"signature (its {kind}s: {sorted(tensors)})"
                )
            if tensor.HasField("reshape"):
                raise LoadError(f"{where}: {kind} {tensor.name!r}: reshape is not supported by servex")
            if any(d == 0 or d < -1 for d in tensor.dims):
                raise LoadError(f"{where}: {kind} {tensor.name!r} has dims {list(tensor.dims)}: each must be -1 "
                                f"(any size) or at least 1")  # fmt: skip
            given = data_types.values_by_number[tensor.data_type].name
            expected = _data_type(spec.dtype)
            if given != expected:
                raise LoadError(
                    f"{where}: {kind} {tensor.name!r} is {given}, but the SavedModel's is {expected} "
                    f"({spec.describe()})"
                )
            dims = [-1, *tensor.dims] if batched else list(tensor.dims)
            shape = spec.shape
            if kind == "output":  # exactly the SavedModel's, as Triton compares outputs
                fits = shape is None or dims == [-1 if m is None else m for m in shape]
            else:
                fits = shape is None or (
                    len(dims) == len(shape) and all(m in (None, d) for d, m in zip(dims, shape, strict=True))
                )
            if not fits:
                batch = " after the batch dimension (max_batch_size > 0)" if batched else ""
                raise LoadError(
                    f"{where}: {kind} {tensor.name!r} has dims {list(tensor.dims)}{batch}, which the SavedModel's "
                    f"{spec.describe()} does not take"
                )
    required = sorted(set(sig.inputs) - set(sig.defaults))
    missing = [alias for alias in required if alias not in {t.name for t in config.input}]
    if config.input and missing:
        raise LoadError(f"{where}: it lists {len(config.input)} input(s), and the SavedModel's {DEFAULT_SIGNATURE!r} "
                        f"signature needs {len(required)}: {missing} missing (list them all, or none)")  # fmt: skip
    if batched:
        fixed = [
            f"{alias} {spec.describe()}"
            for alias, spec in [*sorted(sig.inputs.items()), *[(t.name, sig.outputs[t.name]) for t in config.output]]
            if spec.shape is None or not spec.shape or spec.shape[0] is not None
        ]
        if fixed:
            raise LoadError(
                f"{where}: max_batch_size {max_batch_size} needs every input of the SavedModel, and every "
                f"output listed, to have an unknown 0th dimension (the batch), and {', '.join(fixed)} do(es) not; "
                f"set max_batch_size: 0"
            )


def narrow_signature(model, config, max_batch_size: int) -> None:
    """A repository model's config.pbtxt is its contract, as in Triton: where it lists outputs, the
    ``serving_default`` signature keeps only those, in the file's order (a request naming no output gets them, and
    may name no other); the inputs and outputs it lists take its dims where the SavedModel takes any size (a request
    of another shape is refused, naming the shape the file gives; the 0th dimension takes any size, as for every
    model servex serves, and a batch over max_batch_size runs unbatched where Triton refuses it). ``max_batch_size``
    is the file's or auto-complete's. Called at load, after ``check_config``."""
    sig = model.signatures.get(DEFAULT_SIGNATURE)
    if sig is None or not (config.input or config.output):
        return
    batched = max_batch_size > 0

    def shaped(spec, tensor):
        given = tuple(None if d < 0 else int(d) for d in ([-1, *tensor.dims] if batched else tensor.dims))
        if spec.shape is not None:  # of the same rank (check_config): the SavedModel's sizes, the file's where any
            given = tuple(c if m is None else m for c, m in zip(given, spec.shape, strict=True))
        return dataclasses.replace(spec, shape=given)

    inputs = dict(sig.inputs)
    for tensor in config.input:
        inputs[tensor.name] = shaped(inputs[tensor.name], tensor)
    if config.output:
        aliases = tuple(tensor.name for tensor in config.output)
        outputs = {tensor.name: shaped(sig.outputs[tensor.name], tensor) for tensor in config.output}
        names = tuple(sig.outputs[alias].name for alias in aliases)
    else:
        aliases, outputs, names = sig.output_aliases, sig.outputs, sig.output_names
    model.signatures[DEFAULT_SIGNATURE] = dataclasses.replace(
        sig, inputs=inputs, outputs=outputs, output_aliases=aliases, output_names=names
    )


def batching(config) -> BatchingOptions:
    """A repository model's batching: on with ``dynamic_batching``, batches of at most ``max_batch_size`` rows;
    without it none (as Triton runs each request of such a model alone, servex's automatic batching leaves it).
    Triton's ``preferred_batch_size`` and ``max_queue_delay_microseconds`` change nothing: a free worker never
    waits for a batch to fill, and batches are not padded."""
    if not config.HasField("dynamic_batching"):
        return NO_BATCHING
    return BatchingOptions(max_batch_size=config.max_batch_size)
