"""Reading one SavedModel version (TF1 SavedModelBuilder or TF2 tf.saved_model.save) into a session.

The version's graph is imported once into its own ``tf.Graph`` with a ``tf.compat.v1.Session`` over it; the
graph is then finalized, so nothing later can grow it by accident. Signatures are turned into plain
``Signature`` records (alias -> tensor name, dtype, shape) once, here, so that no request re-reads protobufs.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.framework import versions
from tensorflow.python.saved_model import loader_impl

from servex.loader.checkpoint import (
    VARIABLE_OPS,
    Checkpoint,
    CheckpointEntry,
    object_graph_keys,
    slice_shape,
    variable_checkpoint_entries,
)
from servex.loader.errors import LoadError
from servex.loader.one_thread import OneThreadSession
from servex.loader.variables import RestoreOp, VariableHooks, VariableRecord, VariableStore
from servex.loader.xla import XlaSession

log = logging.getLogger(__name__)

SAVED_MODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")
# Signatures TensorFlow writes for its own bookkeeping; TensorFlow Serving hides them too.
HIDDEN_SIGNATURES = frozenset({"__saved_model_init_op"})


def _check_signature_tensors(graph: tf.Graph, signatures: dict, path: str) -> None:
    """LoadError when a signature names a tensor the graph does not hold."""
    for sig in signatures.values():
        for alias, spec in [*sig.inputs.items(), *sig.outputs.items()]:
            try:
                graph.get_tensor_by_name(spec.name)
            except (KeyError, ValueError) as e:
                raise LoadError(
                    f"{path}: signature {sig.name!r} names tensor {spec.name!r} for {alias!r}, which is not in the "
                    f"graph"
                ) from e


@dataclass(frozen=True)
class TensorSpec:
    """One signature tensor: graph tensor name, dtype (TF enum and NumPy), static shape (None = unknown rank)."""

    name: str
    dtype_enum: int
    dtype: np.dtype
    shape: tuple[int | None, ...] | None

    def describe(self) -> str:
        return f"{types_pb2.DataType.Name(self.dtype_enum)} {shape_text(self.shape)}"


@functools.cache
def dtype_name(dtype: np.dtype) -> str:
    """TensorFlow's name for a NumPy dtype (``DT_FLOAT``; strings and objects ``DT_STRING``), or NumPy's name where
    TensorFlow has none."""
    dtype = np.dtype(dtype)
    if dtype.kind in "SUO":
        return "DT_STRING"
    try:
        return types_pb2.DataType.Name(tf.as_dtype(dtype).as_datatype_enum)
    except TypeError:
        return dtype.name


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
    # The ops each signature runs (from its outputs back to its inputs), walked once at load: they tell which
    # variables a signature's first run restores, and which state-changing ops its runs may run (OpPolicy).
    signature_ops: dict[str, tuple[tf.Operation, ...]] = field(default_factory=dict)
    # The second session whose runs use one intra-op thread, made when a client graph asks (loader/one_thread.py).
    one_thread: OneThreadSession | None = None
    # The third, over a copy of the graph whose function calls XLA compiles, made when a client graph asks
    # (loader/xla.py).
    xla: XlaSession | None = None

    def close(self) -> None:
        for twin in (self.one_thread, self.xla):
            if twin is not None:
                twin.close()
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
            init_op = loader_impl.get_init_op(meta_graph)  # an op, or a tensor
        init_op = getattr(init_op, "op", init_op)
        prefix, sources = _variable_sources(graph, meta_graph, path)
        visible = {n: sig for n, sig in meta_graph.signature_def.items() if n not in HIDDEN_SIGNATURES}
        signature_ops = _signature_ops(graph, visible)
        init_reads = variables_read_by([init_op]) if init_op is not None else []
        if lazy_restore:  # a read per variable, and one per set of variables a restore will likely bring in
            reads = [init_reads, *([op.name for op in ops] for ops in signature_ops.values())]
            groups = _restore_groups(reads, {s.name for s in sources})
        else:  # one read of them all
            groups = [frozenset(s.name for s in sources)] if sources else []
        records, restores = _add_restore_ops(graph, prefix, sources, groups, per_variable=lazy_restore)
        variables = VariableStore(records, session, device, transfer, hooks, restores, checkpoint=prefix)
        needed = init_reads if lazy_restore else list(records)
        ready = variables.ensure(needed)
        if ready is not None:
            ready.result()
        init = _no_init
        if init_op is not None and not _runs_nothing(init_op):
            # The init op, with the assets' paths fed: on this session now, on a second one if one is made.
            assets = loader_impl.get_asset_tensors(path, meta_graph)
            init = functools.partial(_run_init, init_op, assets)
            init(session)
        signatures = {name: _signature(name, sig, path) for name, sig in visible.items()}
        _check_signature_tensors(graph, signatures, path)
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
        path=path,
        graph=graph,
        session=session,
        meta_graph=meta_graph,
        signatures=signatures,
        variables=variables,
        signature_ops=signature_ops,
        one_thread=OneThreadSession(graph, session_config, variables, init_reads, init),
        xla=XlaSession(graph, session_config, variables, chain(*signature_ops.values()), init_reads, init),
    )


def _no_init(session) -> None:
    pass


def _run_init(init_op, assets: dict, session) -> None:
    """By name: a session over a copy of the graph (loader/xla.py) runs it too."""
    session.run(init_op.name, feed_dict=assets)  # the assets' tensors by name already


@dataclass(frozen=True)
class _Source:
    """A variable the checkpoint restores: its op's output, and the checkpoint entry (or slice of one) it reads."""

    name: str
    key: str
    spec: str  # slice spec, "" for the whole entry
    entry: CheckpointEntry  # of the slice, for a part of a partitioned variable
    dtype: tf.DType
    variable: tf.Tensor
    resource: bool


def _variable_sources(graph: tf.Graph, meta_graph, path: str) -> tuple[str, list[_Source]]:
    """The checkpoint's prefix and, sorted by name, the variables the saver restores, each with its checkpoint entry
    (or, for a part of a partitioned variable, its slice of one); a dtype or shape that differs from the variable's
    fails the load."""
    sources = variable_checkpoint_entries(meta_graph)  # variable -> (key, slice spec)
    by_object = object_graph_keys(meta_graph)
    if not sources and not by_object:
        return "", []
    checkpoint = Checkpoint(path)
    for name, key in by_object.items():  # variables the restore function does not name (Keras 3 exports)
        if name not in sources and key in checkpoint.entries:
            sources[name] = (key, "")
    found = []
    for name, (key, spec) in sorted(sources.items()):
        entry = checkpoint.entries.get(key)
        if entry is None:
            raise LoadError(f"{path!r}: variable {name!r} reads checkpoint entry {key!r}, which the index lacks")
        where = f"checkpoint entry {key!r}" + (f" (slice {spec!r})" if spec else "")
        if spec:  # a part of a partitioned variable: what it holds is a slice of the entry
            entry = CheckpointEntry(key, entry.dtype, slice_shape(spec, f"{path!r}: variable {name!r}"))
        variable = graph.get_operation_by_name(name).outputs[0]
        dtype = tf.as_dtype(entry.dtype)
        declared_dtype = tf.as_dtype(variable.op.get_attr("dtype"))
        declared_shape = tf.TensorShape(variable.op.get_attr("shape"))
        if declared_dtype != dtype or not declared_shape.is_compatible_with(entry.shape):
            declared = None if declared_shape.rank is None else tuple(declared_shape.as_list())
            raise LoadError(
                f"{path!r}: variable {name!r} is {declared_dtype.name}{shape_text(declared)}, but its {where} "
                f"holds {dtype.name}{shape_text(entry.shape)}"
            )
        found.append(_Source(name, key, spec, entry, dtype, variable, variable.op.type == "VarHandleOp"))
    return checkpoint.prefix, found


def _add_restore_ops(
    graph: tf.Graph, prefix: str, sources: list[_Source], groups: list[frozenset[str]], per_variable: bool
) -> tuple[dict[str, VariableRecord], list[RestoreOp]]:
    """Add to the graph the ops that read the variables from the checkpoint inside TensorFlow: one ``RestoreV2``
    per group (reading the group's entries together) and, with ``per_variable``, one per variable, each feeding an
    assign per variable it reads. Fed with a new value in place of the read's output, a variable's assign replaces
    its value (AssignVariable); the read then does not run.

    The ops are written as one GraphDef and imported in one call: TensorFlow checks and shapes each node as it
    does any op, without the Python of one op's construction per node (about 0.3 ms each, 2,000 variables 2.8 s
    until 2026-11-24). Fewer nodes also make every later prune of the graph cheaper: 3 per variable (its key, the
    read, the assign), where a placeholder/assign pair per variable for AssignVariable made 5."""
    if not sources:
        return {}, []
    graph_def = graph_pb2.GraphDef()
    graph_def.versions.producer = versions.GRAPH_DEF_VERSION
    graph_def.versions.min_consumer = versions.GRAPH_DEF_VERSION_MIN_CONSUMER
    _string_const(graph_def, "prefix", [prefix], scalar=True)
    _string_const(graph_def, "whole_tensor", [""])  # a read's shape_and_slices: the entire entry
    index = {source.name: i for i, source in enumerate(sources)}
    input_map = {f"variable_{i}": source.variable for i, source in enumerate(sources)}  # no node of graph_def
    reads: list[tuple[str, ...]] = []  # the variables of each read, in the order of its assigns below
    assigns: list[str] = []

    def read(scope: str, members: list[_Source]) -> None:
        keys = _string_const(graph_def, f"{scope}/keys", [s.key for s in members])
        if any(s.spec for s in members) or len(members) > 1:
            slices = _string_const(graph_def, f"{scope}/slices", [s.spec for s in members])
        else:
            slices = "whole_tensor"
        node = graph_def.node.add(name=f"{scope}/read", op="RestoreV2", input=["prefix", keys, slices])
        node.attr["dtypes"].list.type.extend(s.dtype.as_datatype_enum for s in members)
        for k, source in enumerate(members):
            name = f"{scope}/assign" if len(members) == 1 else f"{scope}/assign_{k}"
            inputs = [f"variable_{index[source.name]}", f"{scope}/read:{k}"]
            assign = graph_def.node.add(name=name, input=inputs)
            if source.resource:
                assign.op = "AssignVariableOp"
                assign.attr["dtype"].type = source.dtype.as_datatype_enum
            else:
                assign.op = "Assign"
                assign.attr["T"].type = source.dtype.as_datatype_enum
                assign.attr["validate_shape"].b = True
                assign.attr["use_locking"].b = True
            assigns.append(name)
        reads.append(tuple(s.name for s in members))

    by_name = {source.name: source for source in sources}
    for j, group in enumerate(groups):
        read(f"group_{j}", [by_name[n] for n in sorted(group)])
    if per_variable:
        for i, source in enumerate(sources):
            read(str(i), [source])
    with graph.as_default():
        ops = tf.graph_util.import_graph_def(
            graph_def, input_map=input_map, return_elements=assigns, name="servex_restore"
        )
    restores, records, at = [], {}, 0
    for names in reads:
        done = ops[at : at + len(names)]
        at += len(names)
        restores.append(RestoreOp(frozenset(names), tuple(op.name for op in done)))
        for name, op in zip(names, done, strict=True):
            s = by_name[name]
            records[name] = VariableRecord(
                name, s.key, s.entry.dtype, s.entry.shape, s.entry.nbytes, op.inputs[1].name, op.name, s.resource
            )  # a variable's own read (the last one written) when it has one, else its group's
    return dict(sorted(records.items())), restores


def _string_const(graph_def: graph_pb2.GraphDef, name: str, values: list[str], scalar: bool = False) -> str:
    node = graph_def.node.add(name=name, op="Const")
    node.attr["dtype"].type = types_pb2.DT_STRING
    tensor = node.attr["value"].tensor
    tensor.dtype = types_pb2.DT_STRING
    if not scalar:
        tensor.tensor_shape.dim.add(size=len(values))
    tensor.string_val.extend(v.encode() for v in values)
    return name


def _signature_ops(graph: tf.Graph, signatures: dict) -> dict[str, tuple[tf.Operation, ...]]:
    """The ops each signature runs: from its outputs back to its inputs (a signature naming a tensor the graph
    lacks is left out; the load fails on it)."""
    found = {}
    for name, sig in signatures.items():
        try:
            outputs = [graph.get_tensor_by_name(info.name).op for info in sig.outputs.values()]
        except (KeyError, ValueError):
            continue
        found[name] = tuple(walk(outputs, frozenset(info.name for info in sig.inputs.values())))
    return found


def _restore_groups(reads: list[list[str]], variables: set[str]) -> list[frozenset[str]]:
    """The sets of variables that one restore will likely bring in together, as lazy restoration goes: those the
    init op reads (at load) and those each signature reads (its first run). Each set of two or more gets a read of
    its own, so that its restore builds and runs one RestoreV2, not one per variable: TensorFlow prunes and
    optimizes a graph of half the nodes (2,000 variables: about 1.2 s less). ``reads``: for each, the names of
    the ops it runs (or of the variables it reads); ``variables``: the variables the checkpoint restores."""
    groups = []
    for names in reads:
        group = variables.intersection(names)
        if len(group) > 1 and group not in groups:
            groups.append(frozenset(group))
    return groups


def _runs_nothing(op) -> bool:
    """An init op that is a NoOp with no inputs (what a TF2 export without tables writes): running it would
    change nothing, but TensorFlow would prune and optimize the whole graph to run it (2,000 variables: about 1 s)."""
    return op.type == "NoOp" and not op.inputs and not op.control_inputs


def walk(roots, fed: frozenset[str] = frozenset()) -> list:
    """The ops TensorFlow runs for ``roots`` (ops) when the tensors named in ``fed`` are fed: everything they
    reach back through data and control edges, stopping at fed tensors."""
    seen, ops = set(), []
    stack = list(roots)
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        ops.append(op)
        stack.extend(t.op for t in op.inputs if t.name not in fed)
        stack.extend(op.control_inputs)
    return ops


def variables_read_by(roots, fed: frozenset[str] = frozenset()) -> list[str]:
    """The variable ops that running ``roots`` reads, ``fed`` fed (e.g. an init op that initializes a table from a
    variable)."""
    return [op.name for op in walk(roots, fed) if op.type in VARIABLE_OPS]
