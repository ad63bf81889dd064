"""Reading one SavedModel version (TF1 SavedModelBuilder or TF2 tf.saved_model.save) into a session.

The version's graph is imported once into its own ``tf.Graph`` with a ``tf.compat.v1.Session`` over it; the
graph is then finalized, so nothing later can grow it by accident. Signatures are turned into plain
``Signature`` records (alias -> tensor name, dtype, shape) once, here, so that no request re-reads protobufs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.saved_model import loader_impl

from loader.checkpoint import (
    VARIABLE_OPS,
    Checkpoint,
    CheckpointEntry,
    object_graph_keys,
    slice_shape,
    variable_checkpoint_entries,
)
from loader.errors import LoadError
from loader.variables import VariableHooks, VariableRecord, VariableStore

log = logging.getLogger(__name__)

SAVED_MODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")
# Signatures TensorFlow writes for its own bookkeeping; TensorFlow Serving hides them too.
HIDDEN_SIGNATURES = frozenset({"__saved_model_init_op"})


@dataclass(frozen=True)
class TensorSpec:
    """One signature tensor: graph tensor name, dtype (TF enum and NumPy), static shape (None = unknown rank)."""

    name: str
    dtype_enum: int
    dtype: np.dtype
    shape: tuple[int | None, ...] | None

    def describe(self) -> str:
        return f"{types_pb2.DataType.Name(self.dtype_enum)} {shape_text(self.shape)}"


def shape_text(shape: tuple[int | None, ...] | None) -> str:
    """A static shape as TensorFlow Serving prints it: ``[-1,3]``, ``?`` for unknown rank."""
    if shape is None:
        return "?"
    return "[" + ",".join("-1" if d is None else str(d) for d in shape) + "]"


def shape_matches(static: tuple[int | None, ...] | None, actual: tuple[int, ...]) -> bool:
    """Whether a concrete shape fits a signature's static shape.

    Of the same rank, every dimension after the 0th must agree (None and unknown rank match anything). The 0th
    dimension is the batch dimension and takes any size, as TensorFlow Serving lets it: signatures exported with a
    fixed batch (TF2's half_plus_two declares x as [1]) still serve other batch sizes. Another rank is left to
    TensorFlow, as TensorFlow Serving leaves it: its graphs often take it (``{"instances": [1.0, 2.0, 5.0]}`` on
    half_plus_two's x [-1,1], TensorFlow Serving's own REST example), and an op that cannot says so when it runs.
    """
    if static is None or len(static) != len(actual):
        return True
    for i in range(1, len(static)):  # a loop, not all(...): called once per input of every request
        if static[i] is not None and static[i] != actual[i]:
            return False
    return True


@dataclass(frozen=True)
class Signature:
    name: str
    method_name: str
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    # All output aliases in a fixed order, and their tensor names, for requests without an output filter.
    output_aliases: tuple[str, ...] = field(default=())
    output_names: tuple[str, ...] = field(default=())
    # Values of the inputs a request may leave out (SignatureDef.defaults: a TF2 function's arguments with
    # defaults), read-only, by alias.
    defaults: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class SavedModelVersion:
    """A loaded version: its graph and session, the MetaGraphDef it came from, and its signatures."""

    path: str
    graph: tf.Graph
    session: tf.compat.v1.Session
    meta_graph: meta_graph_pb2.MetaGraphDef
    signatures: dict[str, Signature]
    variables: VariableStore

    def close(self) -> None:
        self.session.close()


def _tensor_spec(info: meta_graph_pb2.TensorInfo, where: str) -> TensorSpec:
    if info.WhichOneof("encoding") != "name":
        raise LoadError(
            f"{where}: only dense tensors are supported, this one is encoded as {info.WhichOneof('encoding')}"
        )
    shape = None  # old exports leave tensor_shape out entirely: unknown, like unknown_rank
    if info.HasField("tensor_shape") and not info.tensor_shape.unknown_rank:
        shape = tuple(None if d.size < 0 else d.size for d in info.tensor_shape.dim)
    dtype = tf.dtypes.as_dtype(info.dtype)
    return TensorSpec(name=info.name, dtype_enum=info.dtype, dtype=np.dtype(dtype.as_numpy_dtype), shape=shape)


def _signature(name: str, sig: meta_graph_pb2.SignatureDef, path: str) -> Signature:
    where = f"{path}: signature {name!r}"
    inputs = {alias: _tensor_spec(info, f"{where} input {alias!r}") for alias, info in sig.inputs.items()}
    outputs = {alias: _tensor_spec(info, f"{where} output {alias!r}") for alias, info in sig.outputs.items()}
    aliases = tuple(sorted(outputs))
    defaults = {}
    for alias, proto in sig.defaults.items():
        if alias not in inputs:
            raise LoadError(f"{where}: a default is given for {alias!r}, which is not one of its inputs")
        value = tf.make_ndarray(proto)
        spec = inputs[alias]
        if value.dtype != spec.dtype or not shape_matches(spec.shape, value.shape):
            raise LoadError(
                f"{where}: the default of input {alias!r} is {types_pb2.DataType.Name(proto.dtype)} "
                f"{shape_text(value.shape)}, but the input is {spec.describe()}"
            )
        value.flags.writeable = False  # fed to every request that leaves the input out
        defaults[alias] = value
    return Signature(
        name=name,
        method_name=sig.method_name,
        inputs=inputs,
        outputs=outputs,
        output_aliases=aliases,
        output_names=tuple(outputs[a].name for a in aliases),
        defaults=defaults,
    )


def load_saved_model(
    path: str,
    tags: tuple[str, ...] = ("serve",),
    session_config: tf.compat.v1.ConfigProto | None = None,
    *,
    lazy_restore: bool = True,
    device: str = "cpu",
    transfer=None,
    hooks: VariableHooks | None = None,
) -> SavedModelVersion:
    """Load the SavedModel at ``path``; raise LoadError naming the path and what is wrong.

    The graph and the checkpoint's index are read (and the data files checked against the index); with
    ``lazy_restore`` no variable's data is read until a client graph needs it (or the init op does).
    """
    if not os.path.isdir(path):
        raise LoadError(f"SavedModel path {path!r} does not exist or is not a directory")
    if not any(os.path.isfile(os.path.join(path, f)) for f in SAVED_MODEL_FILES):
        raise LoadError(
            f"{path!r} is not a SavedModel: it holds no saved_model.pb or saved_model.pbtxt "
            f"(found: {sorted(os.listdir(path))})"
        )
    graph = tf.Graph()
    session = tf.compat.v1.Session(graph=graph, config=session_config)
    try:
        loader = loader_impl.SavedModelLoader(path)
        meta_graph = loader.get_meta_graph_def_from_tags(list(tags))
        with graph.as_default():
            loader.load_graph(graph, list(tags))
            records = _variable_records(graph, meta_graph, path)
        variables = VariableStore(records, session, device, transfer, hooks)
        with graph.as_default():
            init_op = loader_impl.get_init_op(meta_graph)
        needed = list(records) if not lazy_restore else _variables_read_by([init_op] if init_op is not None else [])
        ready = variables.ensure(needed)
        if ready is not None:
            ready.result()
        loader.run_init_ops(session, list(tags))
        signatures = {
            name: _signature(name, sig, path)
            for name, sig in meta_graph.signature_def.items()
            if name not in HIDDEN_SIGNATURES
        }
        for sig in signatures.values():
            for alias, spec in [*sig.inputs.items(), *sig.outputs.items()]:
                try:
                    graph.get_tensor_by_name(spec.name)
                except (KeyError, ValueError) as e:
                    raise LoadError(
                        f"{path}: signature {sig.name!r} names tensor {spec.name!r} for {alias!r}, "
                        f"which is not in the graph"
                    ) from e
    except LoadError:
        session.close()
        raise
    except Exception as e:  # TensorFlow raises many types; all mean "this folder does not load"
        session.close()
        raise LoadError(f"cannot load SavedModel at {path!r} with tags {list(tags)}: {e}") from e
    graph.finalize()
    log.info(
        "loaded SavedModel %s (signatures: %s; %d variables, %s)",
        path,
        ", ".join(sorted(signatures)) or "none",
        len(records),
        "restored lazily" if lazy_restore else "all restored",
    )
    return SavedModelVersion(
        path=path, graph=graph, session=session, meta_graph=meta_graph, signatures=signatures, variables=variables
    )


def _variable_records(graph: tf.Graph, meta_graph, path: str) -> dict[str, VariableRecord]:
    """For each variable the saver restores: its checkpoint entry (or, for a part of a partitioned variable, its
    slice of one), the op that restores it from there inside TensorFlow, and a placeholder/assign pair to replace
    its value."""
    sources = variable_checkpoint_entries(meta_graph)  # variable -> (key, slice spec)
    by_object = object_graph_keys(meta_graph)
    if not sources and not by_object:
        return {}
    checkpoint = Checkpoint(path)
    for name, key in by_object.items():  # variables the restore function does not name (Keras 3 exports)
        if name not in sources and key in checkpoint.entries:
            sources[name] = (key, "")
    with tf.name_scope("servex_restore"):
        prefix = tf.constant(checkpoint.prefix, name="prefix")
        whole = tf.constant([""], name="whole_tensor")  # RestoreV2's shape_and_slices: the entire entry
    records = {}
    for i, (name, (key, spec)) in enumerate(sorted(sources.items())):
        entry = checkpoint.entries.get(key)
        if entry is None:
            raise LoadError(f"{path!r}: variable {name!r} reads checkpoint entry {key!r}, which the index lacks")
        where = f"checkpoint entry {key!r}" + (f" (slice {spec!r})" if spec else "")
        if spec:  # a part of a partitioned variable: what it holds is a slice of the entry
            entry = CheckpointEntry(key, entry.dtype, slice_shape(spec, f"{path!r}: variable {name!r}"))
        variable = graph.get_operation_by_name(name).outputs[0]
        resource = variable.op.type == "VarHandleOp"
        dtype = tf.as_dtype(entry.dtype)
        declared_dtype = tf.as_dtype(variable.op.get_attr("dtype"))
        declared_shape = tf.TensorShape(variable.op.get_attr("shape"))
        if declared_dtype != dtype or not declared_shape.is_compatible_with(entry.shape):
            declared = None if declared_shape.rank is None else tuple(declared_shape.as_list())
            raise LoadError(
                f"{path!r}: variable {name!r} is {declared_dtype.name}{shape_text(declared)}, but its {where} "
                f"holds {dtype.name}{shape_text(entry.shape)}"
            )
        with tf.name_scope(f"servex_restore/{i}"):
            value = tf.compat.v1.placeholder(dtype, shape=entry.shape, name="value")
            assign = _assign(variable, value, resource, "assign")
            part = tf.constant([spec], name="slice") if spec else whole
            stored = tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=[key], shape_and_slices=part, dtypes=[dtype])
            restore = _assign(variable, stored[0], resource, "restore")
        records[name] = VariableRecord(
            name, key, entry.dtype, entry.shape, entry.nbytes, value.name, assign.name, restore.name, resource
        )
    return records


def _assign(variable: tf.Tensor, value: tf.Tensor, resource: bool, name: str) -> tf.Operation:
    if resource:
        return tf.raw_ops.AssignVariableOp(resource=variable, value=value, name=name)
    return tf.raw_ops.Assign(ref=variable, value=value, validate_shape=True, use_locking=True, name=name).op


def _variables_read_by(ops) -> list[str]:
    """Variable ops the given ops read (e.g. an init op that initializes a table from a variable)."""
    seen, found, stack = set(), [], list(ops)
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in VARIABLE_OPS:
            found.append(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return found
