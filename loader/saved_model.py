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

from loader.errors import LoadError

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

    Rank and every dimension after the 0th must agree (None and unknown rank match anything). The 0th
    dimension is the batch dimension and takes any size, as TensorFlow Serving lets it: signatures exported with a
    fixed batch (TF2's half_plus_two declares x as [1]) still serve other batch sizes.
    """
    if static is None:
        return True
    if len(static) != len(actual):
        return False
    return all(d is None or d == a for d, a in zip(static[1:], actual[1:], strict=True))


@dataclass(frozen=True)
class Signature:
    name: str
    method_name: str
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    # All output aliases in a fixed order, and their tensor names, for requests without an output filter.
    output_aliases: tuple[str, ...] = field(default=())
    output_names: tuple[str, ...] = field(default=())


@dataclass
class SavedModelVersion:
    """A loaded version: its graph and session, the MetaGraphDef it came from, and its signatures."""

    path: str
    graph: tf.Graph
    session: tf.compat.v1.Session
    meta_graph: meta_graph_pb2.MetaGraphDef
    signatures: dict[str, Signature]

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
    return Signature(
        name=name,
        method_name=sig.method_name,
        inputs=inputs,
        outputs=outputs,
        output_aliases=aliases,
        output_names=tuple(outputs[a].name for a in aliases),
    )


def load_saved_model(
    path: str, tags: tuple[str, ...] = ("serve",), session_config: tf.compat.v1.ConfigProto | None = None
) -> SavedModelVersion:
    """Load the SavedModel at ``path``; raise LoadError naming the path and what is wrong."""
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
        with graph.as_default():
            meta_graph = tf.compat.v1.saved_model.loader.load(session, list(tags), path)
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
    log.info("loaded SavedModel %s (signatures: %s)", path, ", ".join(sorted(signatures)) or "none")
    return SavedModelVersion(path=path, graph=graph, session=session, meta_graph=meta_graph, signatures=signatures)
