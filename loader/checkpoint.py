"""A SavedModel's variables and its checkpoint: which graph variable is which checkpoint entry, what the index
says about each (dtype, shape), whether the data files hold what the index implies, and reading one tensor.

Only the index is read at load; a tensor's data is read when ``read`` asks for it.
"""

from __future__ import annotations

import glob
import math
import os
from collections import deque
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from servex.loader.errors import LoadError

VARIABLE_OPS = frozenset({"VariableV2", "Variable", "VarHandleOp"})
ASSIGN_OPS = frozenset({"Assign", "AssignVariableOp"})


def _parse_graph_ref(ref: str) -> tuple[str, int]:
    """A top-level graph input: ``node``, ``node:k`` (``^node`` is a control input)."""
    name, _, index = ref.lstrip("^").partition(":")
    return name, int(index or 0)


def _parse_function_ref(ref: str) -> tuple[str, int]:
    """A function-body input: ``arg``, ``node:output_name:k``."""
    parts = ref.lstrip("^").split(":")
    return parts[0], int(parts[2]) if len(parts) == 3 else 0


def _keys_in(nodes: dict, parse, resolve_variable) -> dict[str, tuple[str, str]]:
    """Variable -> (checkpoint key, slice spec), from the RestoreV2 ops among ``nodes`` and the assigns they feed."""
    found = {}
    decoded: dict[str, list[str]] = {}  # Const node -> its strings, decoded once (one RestoreV2 names them all)

    def strings(ref: str) -> list[str] | None:
        node = nodes.get(parse(ref)[0])
        if node is None or node.op != "Const":
            return None
        if node.name not in decoded:
            decoded[node.name] = [v.decode() for v in node.attr["value"].tensor.string_val]
        return decoded[node.name]

    for node in nodes.values():
        if node.op not in ASSIGN_OPS:
            continue
        source, index = parse(node.input[1])
        while source in nodes and nodes[source].op == "Identity":  # RestoreV2 -> Identity* -> assign
            source, index = parse(nodes[source].input[0])
        restore = nodes.get(source)
        if restore is None or restore.op != "RestoreV2":
            continue
        keys, slices = strings(restore.input[1]), strings(restore.input[2])
        variable = resolve_variable(node.input[0])
        if variable is not None and keys is not None and index < len(keys):
            found[variable] = (keys[index], slices[index] if slices and index < len(slices) else "")
    return found


def variable_checkpoint_entries(meta_graph: meta_graph_pb2.MetaGraphDef) -> dict[str, tuple[str, str]]:
    """Map each variable op of the graph to its checkpoint key and slice spec, read off the saver's restore op.

    TF1 graphs restore at the top level (``save/RestoreV2`` -> ``Assign``); TF2 graphs call a restore function
    whose arguments are the variables' handles. The slice spec is empty for a whole tensor; a TF1 partitioned
    variable's parts each read a slice of one entry (``"10 4 0,5:0,4"``: the full shape, then start,length per
    dimension).
    """
    graph: graph_pb2.GraphDef = meta_graph.graph_def
    nodes = {n.name: n for n in graph.node}

    def top_level_variable(ref: str) -> str | None:
        name = _parse_graph_ref(ref)[0]
        return name if name in nodes and nodes[name].op in VARIABLE_OPS else None

    entries = _keys_in(nodes, _parse_graph_ref, top_level_variable)
    restore_name = _parse_graph_ref(meta_graph.saver_def.restore_op_name)[0] if meta_graph.saver_def else ""
    call = nodes.get(restore_name)
    functions = {f.signature.name: f for f in graph.library.function}
    if call is not None and "f" in call.attr and call.attr["f"].func.name in functions:
        function = functions[call.attr["f"].func.name]
        args = {a.name: i for i, a in enumerate(function.signature.input_arg)}
        call_inputs = [i for i in call.input if not i.startswith("^")]

        def argument_variable(ref: str) -> str | None:
            index = args.get(_parse_function_ref(ref)[0])
            return None if index is None else top_level_variable(call_inputs[index])

        entries.update(_keys_in({n.name: n for n in function.node_def}, _parse_function_ref, argument_variable))
    return entries


def slice_shape(spec: str, where: str) -> tuple[int, ...]:
    """The shape of the slice a slice spec (``"10 4 0,5:0,4"``, ``-`` for a whole dimension) reads."""
    full, _, extents = spec.rpartition(" ")
    try:
        dims = [int(d) for d in full.split()]
        parts = extents.split(":")
        if len(parts) != len(dims):
            raise ValueError(f"{len(parts)} extents for {len(dims)} dimensions")
        return tuple(d if part == "-" else int(part.split(",")[1]) for d, part in zip(dims, parts, strict=True))
    except (ValueError, IndexError) as e:
        raise LoadError(f"{where}: slice spec {spec!r} is not understood: {e}") from e


VARIABLE_VALUE = ".ATTRIBUTES/VARIABLE_VALUE"


def object_graph_keys(meta_graph: meta_graph_pb2.MetaGraphDef) -> dict[str, str]:
    """TF2: map variable ops to checkpoint keys through the SavedModel's object graph, as TensorFlow's own object
    loader restores them: a variable's key is the first path to it from the root, breadth first, in children
    order (local names escaped as checkpoints escape them), and its op is the graph's variable op of that name.

    The restore function usually says the same; this covers the variables it does not name. A Keras 3 model saved
    with ``tf.saved_model.save`` serves from handles (``embedding/embeddings``) that its restore function never
    assigns: it restores a second handle (``Variable``) instead, and TensorFlow's object loader, going by the
    object graph, does not notice."""
    objects = meta_graph.object_graph_def.nodes
    if not objects:
        return {}
    ops = {}
    for node in meta_graph.graph_def.node:
        if node.op in VARIABLE_OPS:
            ops.setdefault(node.attr["shared_name"].s.decode() or node.name, node.name)
    found: dict[str, str] = {}
    seen = {0}
    queue = deque([(0, "")])
    while queue:
        index, path = queue.popleft()
        node = objects[index]
        if node.WhichOneof("kind") == "variable" and node.variable.name in ops:
            found.setdefault(ops[node.variable.name], f"{path}/{VARIABLE_VALUE}")
        for child in node.children:
            if child.node_id not in seen and child.node_id < len(objects):
                seen.add(child.node_id)
                name = child.local_name.replace(".", "..").replace("/", ".S")
                queue.append((child.node_id, f"{path}/{name}" if path else name))
    return found


@dataclass(frozen=True)
class CheckpointEntry:
    key: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return 0 if self.dtype == object else math.prod(self.shape) * self.dtype.itemsize


class Checkpoint:
    """The variables checkpoint of a SavedModel: its index (names, dtypes, shapes), read at open. The data is read
    later by TensorFlow itself, straight into the variables (see ``loader.variables``)."""

    def __init__(self, saved_model_path: str):
        self.prefix = os.path.join(saved_model_path, "variables", "variables")
        index = self.prefix + ".index"
        if not os.path.isfile(index):
            raise LoadError(f"{saved_model_path!r} has variables but no checkpoint index at {index!r}")
        try:
            reader = tf.train.load_checkpoint(self.prefix)
        except Exception as e:  # the index itself is unreadable
            raise LoadError(f"cannot read the checkpoint index {index!r}: {e}") from e
        shapes = reader.get_variable_to_shape_map()
        dtypes = reader.get_variable_to_dtype_map()
        self.entries = {
            key: CheckpointEntry(key, np.dtype(dtypes[key].as_numpy_dtype), tuple(shapes[key])) for key in shapes
        }
        self._check_data_files(saved_model_path)

    def _check_data_files(self, saved_model_path: str) -> None:
        """The data shards exist and hold at least the bytes the index implies (a half-copied or truncated
        checkpoint fails here, at load, not at the first request that needs a variable)."""
        shards = sorted(glob.glob(self.prefix + ".data-*"))
        expected = sum(e.nbytes for e in self.entries.values())
        if not shards:
            if expected:
                raise LoadError(f"{saved_model_path!r}: the checkpoint index lists data, but there is no data file")
            return
        found = sum(os.path.getsize(s) for s in shards)
        if found < expected:
            raise LoadError(
                f"{saved_model_path!r}: the checkpoint data files hold {found} bytes, but the index describes "
                f"{expected} bytes of tensors: truncated or still being copied "
                f"({', '.join(os.path.basename(s) for s in shards)})"
            )
