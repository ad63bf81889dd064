"""Which ops a client graph may run: what changes the model for every client, or touches files, only as a signature.

Runs by tensor name (TensorFlow Serving's SessionRun, servex.v1 GraphExecutor.Run, with or without a graph name)
are served on the public port, and a model's graph holds more than its signatures: the initializers' ``Assign``
ops, the ``Saver``'s ``SaveV2``/``RestoreV2``, a TF2 export's save and restore functions. Run by name, those let
any client rewrite a served variable for every client (feed ``a/initial_value:0``, target ``a/Assign``) or write
checkpoint files to a path of its choosing (feed ``save/Const:0``, fetch ``save/control_dependency:0``).

So a client graph may contain an op of a type in ``STATE_CHANGING_OPS`` (or a function call whose functions run
one, at any depth) only when that op belongs to one of the model's signatures' own subgraphs (the ops a run of
the signature's outputs from its inputs runs), and only when whatever the client graph feeds upstream of it is
among that signature's inputs: a run may do what the signature does, with the inputs the signature takes, and
nothing else. Signature runs (Predict, Classify, Regress, MultiInference, KServe v2) pass by construction, and so
does a run by name of a signature's own tensors, as TensorFlow Serving's test model ``saved_model_counter``
(whose signatures assign a counter) is run through SessionRun. Anything else is PERMISSION_DENIED, naming the op
and its type; variables are replaced through the admin API's ``AssignVariable``, which is logged and counted.

What is allowed is computed once per loaded model (``OpPolicy``), on its first client-graph build; each build then
checks the ops its pruned graph runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from tensorflow.python.framework import op_def_registry

from servex.loader.errors import PermissionDenied
from servex.loader.saved_model import walk

# Ops that change state every client of the model shares, or read, write or list files. Grouped by what they do;
# TensorFlow 2.21's op registry was the source (a test checks that every optimizer, scatter and assign op it
# registers is here).
VARIABLE_WRITES = frozenset(
    {
        # assignment, in place or to a resource variable
        "Assign", "AssignAdd", "AssignSub", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
        "AssignVariableXlaConcatND", "CountUpTo", "ResourceCountUpTo", "StridedSliceAssign",
        "ResourceStridedSliceAssign",
        # scatter updates of a variable (not the pure TensorScatter*/ScatterNd, which return a new tensor)
        "ScatterUpdate", "ScatterAdd", "ScatterSub", "ScatterMul", "ScatterDiv", "ScatterMin", "ScatterMax",
        "ScatterNdUpdate", "ScatterNdAdd", "ScatterNdSub", "ScatterNdMin", "ScatterNdMax",
        "ResourceScatterUpdate", "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterMul",
        "ResourceScatterDiv", "ResourceScatterMin", "ResourceScatterMax", "ResourceScatterNdUpdate",
        "ResourceScatterNdAdd", "ResourceScatterNdSub", "ResourceScatterNdMin", "ResourceScatterNdMax",
        # optimizer steps (they update the variable they are given)
        "ApplyAdaMax", "ApplyAdadelta", "ApplyAdagrad", "ApplyAdagradDA", "ApplyAdagradV2", "ApplyAdam",
        "ApplyAddSign", "ApplyCenteredRMSProp", "ApplyFtrl", "ApplyFtrlV2", "ApplyGradientDescent", "ApplyMomentum",
        "ApplyPowerSign", "ApplyProximalAdagrad", "ApplyProximalGradientDescent", "ApplyRMSProp",
        "ResourceApplyAdaMax", "ResourceApplyAdadelta", "ResourceApplyAdagrad", "ResourceApplyAdagradDA",
        "ResourceApplyAdagradV2", "ResourceApplyAdam", "ResourceApplyAdamWithAmsgrad", "ResourceApplyAddSign",
        "ResourceApplyCenteredRMSProp", "ResourceApplyFtrl", "ResourceApplyFtrlV2", "ResourceApplyGradientDescent",
        "ResourceApplyKerasMomentum", "ResourceApplyMomentum", "ResourceApplyPowerSign",
        "ResourceApplyProximalAdagrad", "ResourceApplyProximalGradientDescent", "ResourceApplyRMSProp",
        "ResourceSparseApplyAdadelta", "ResourceSparseApplyAdagrad", "ResourceSparseApplyAdagradDA",
        "ResourceSparseApplyAdagradV2", "ResourceSparseApplyCenteredRMSProp", "ResourceSparseApplyFtrl",
        "ResourceSparseApplyFtrlV2", "ResourceSparseApplyKerasMomentum", "ResourceSparseApplyMomentum",
        "ResourceSparseApplyProximalAdagrad", "ResourceSparseApplyProximalGradientDescent",
        "ResourceSparseApplyRMSProp", "SparseApplyAdadelta", "SparseApplyAdagrad", "SparseApplyAdagradDA",
        "SparseApplyAdagradV2", "SparseApplyCenteredRMSProp", "SparseApplyFtrl", "SparseApplyFtrlV2",
        "SparseApplyMomentum", "SparseApplyProximalAdagrad", "SparseApplyProximalGradientDescent",
        "SparseApplyRMSProp", "NegTrain", "SdcaShrinkL1",
        # deleting a variable or changing how it is read (VarHandleOp, which only names one, is fine)
        "DestroyResourceOp", "DestroyTemporaryVariable", "DisableCopyOnRead",
    }
)  # fmt: skip
TABLE_WRITES = frozenset(
    {
        "InitializeTable", "InitializeTableV2", "InitializeTableFromTextFile", "InitializeTableFromTextFileV2",
        "InitializeTableFromDataset", "LookupTableInsert", "LookupTableInsertV2", "LookupTableRemoveV2",
        "LookupTableImport", "LookupTableImportV2",
    }
)  # fmt: skip
# Queues, barriers, staging areas and accumulators live in the session, shared by every run (a dequeue from an
# empty one blocks a run worker for good); session handles keep tensors alive in it.
SHARED_QUEUES = frozenset(
    {
        "QueueEnqueue", "QueueEnqueueV2", "QueueEnqueueMany", "QueueEnqueueManyV2", "QueueDequeue", "QueueDequeueV2",
        "QueueDequeueMany", "QueueDequeueManyV2", "QueueDequeueUpTo", "QueueDequeueUpToV2", "QueueClose",
        "QueueCloseV2", "BarrierInsertMany", "BarrierTakeMany", "BarrierClose", "Stage", "Unstage", "StagePeek",
        "StageClear", "MapStage", "MapUnstage", "MapUnstageNoKey", "MapPeek", "MapClear", "OrderedMapStage",
        "OrderedMapUnstage", "OrderedMapUnstageNoKey", "OrderedMapPeek", "OrderedMapClear",
        "AccumulatorApplyGradient", "AccumulatorTakeGradient", "AccumulatorSetGlobalStep",
        "SparseAccumulatorApplyGradient", "SparseAccumulatorTakeGradient", "ResourceAccumulatorApplyGradient",
        "ResourceAccumulatorTakeGradient", "ResourceAccumulatorSetGlobalStep", "GetSessionHandle",
        "GetSessionHandleV2", "DeleteSessionTensor",
    }
)  # fmt: skip
FILE_OPS = frozenset(
    {
        # checkpoints
        "Save", "SaveV2", "SaveSlices", "Restore", "RestoreV2", "RestoreSlice", "DTensorRestoreV2",
        "MergeV2Checkpoints", "LoadAndRemapMatrix", "GenerateVocabRemapping",
        # files and directories
        "ReadFile", "WriteFile", "MatchingFiles", "DumpTensor", "CalibrationStatisticsSaver",
        "FileSystemSetConfiguration", "ReaderRead", "ReaderReadV2", "ReaderReadUpTo", "ReaderReadUpToV2",
        "ReaderReset", "ReaderResetV2", "ReaderRestoreState", "ReaderRestoreStateV2",
        # datasets that read or write files
        "TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset", "FixedLengthRecordDataset",
        "FixedLengthRecordDatasetV2", "CSVDataset", "CSVDatasetV2", "ExperimentalCSVDataset", "LMDBDataset",
        "ExperimentalLMDBDataset", "SqlDataset", "ExperimentalSqlDataset", "MatchingFilesDataset",
        "ExperimentalMatchingFilesDataset", "CacheDataset", "CacheDatasetV2", "SnapshotDataset", "SnapshotDatasetV2",
        "SnapshotDatasetReader", "SnapshotNestedDatasetReader", "SnapshotChunkDataset", "ListSnapshotChunksDataset",
        "LoadDataset", "SaveDataset", "SaveDatasetV2", "DistributedSave", "DatasetToTFRecord",
        "ExperimentalDatasetToTFRecord",
        # summary writers
        "CreateSummaryFileWriter", "CreateSummaryDbWriter", "WriteSummary", "WriteScalarSummary",
        "WriteHistogramSummary", "WriteImageSummary", "WriteAudioSummary", "WriteGraphSummary", "WriteRawProtoSummary",
        "ImportEvent", "FlushSummaryWriter", "CloseSummaryWriter", "StatsAggregatorSetSummaryWriter",
    }
)  # fmt: skip
STATE_CHANGING_OPS = VARIABLE_WRITES | TABLE_WRITES | SHARED_QUEUES | FILE_OPS


def _attr_functions(values: Iterable) -> list[str]:
    """Names of the functions that AttrValues (of a NodeDef in a FunctionDef) call."""
    names = []
    for value in values:
        kind = value.WhichOneof("value")
        if kind == "func":
            names.append(value.func.name)
        elif kind == "list":
            names.extend(f.name for f in value.list.func)
    return names


class OpPolicy:
    """Which state-changing ops of one loaded model's graph a client graph may run, and with which feeds.

    Built once per model version: the state-changing ops of each signature's subgraph (from its outputs back to
    its inputs, through data and control edges), each with the input tensors of the signatures it belongs to.
    """

    def __init__(self, graph, library, signatures, signature_ops=None):
        """``graph`` (a tf.Graph), ``library`` (its FunctionDefLibrary), ``signatures`` (name -> Signature),
        ``signature_ops`` (name -> the ops the signature runs, as ``walk`` finds them, when the loader walked
        them already)."""
        self._functions = {f.signature.name: f for f in library.function}
        self._function_ops: dict[str, frozenset[str]] = {}  # function name -> every op type it runs, at any depth
        self._bodies: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {}  # its own types, the functions it calls
        self._op_kinds: dict[str, tuple[str, ...]] = {}  # op name -> its state-changing op types (() if none)
        self._func_attrs: dict[str, tuple[str, ...]] = {}  # op type -> its attributes that name functions
        # state-changing op name -> the input tensor names of each signature whose subgraph holds it
        allowed: dict[str, list[frozenset[str]]] = {}
        for sig in signatures.values():
            inputs = frozenset(spec.name for spec in sig.inputs.values())
            ops = (signature_ops or {}).get(sig.name)
            if ops is None:
                ops = walk([graph.get_tensor_by_name(spec.name).op for spec in sig.outputs.values()], inputs)
            for op in ops:
                if self.kinds(op):
                    allowed.setdefault(op.name, []).append(inputs)
        self.allowed = {name: tuple(sets) for name, sets in allowed.items()}

    # -- what an op does ---------------------------------------------------------------------------------------

    def kinds(self, op) -> tuple[str, ...]:
        """The state-changing op types ``op`` runs: its own type, or those of the functions it calls."""
        kinds = self._op_kinds.get(op.name)
        if kinds is None:
            if op.type in STATE_CHANGING_OPS:
                kinds = (op.type,)
            else:
                kinds = tuple(sorted(self.types(op) & STATE_CHANGING_OPS))
            self._op_kinds[op.name] = kinds
        return kinds

    def types(self, op) -> frozenset[str]:
        """The op types ``op`` runs: its own, and those of the functions it calls, at any depth."""
        found = {op.type}
        for name in self._called(op):
            found |= self._function_types(name)
        return frozenset(found)

    def _called(self, op) -> list[str]:
        """The functions a graph op calls: a direct call (its type is a library function) or function attributes
        (PartitionedCall, StatefulPartitionedCall, If, While, Case, dataset transformations ...)."""
        if op.type in self._functions:
            return [op.type]
        attrs = self._func_attrs.get(op.type)
        if attrs is None:
            attrs = self._func_attrs[op.type] = _function_attrs(op.type)
        names = []
        for attr in attrs:
            try:
                value = op.get_attr(attr)
            except ValueError:  # an optional function attribute this node leaves unset
                continue
            names.extend(v.name for v in (value if isinstance(value, list) else [value]))
        return names

    def _function_types(self, name: str) -> frozenset[str]:
        """The op types function ``name`` runs, itself or through the functions it calls."""
        kinds = self._function_ops.get(name)
        if kinds is None:
            found: set[str] = set()
            seen, stack = {name}, [name]
            while stack:  # every function reachable from this one (calls may recurse)
                direct, calls = self._function_body(stack.pop())
                found |= direct
                for called in calls:
                    if called not in seen:
                        seen.add(called)
                        stack.append(called)
            kinds = self._function_ops[name] = frozenset(found)  # complete when stored: safe across threads
        return kinds

    def _function_body(self, name: str) -> tuple[frozenset[str], tuple[str, ...]]:
        """Function ``name``'s own op types, and the functions its nodes call."""
        body = self._bodies.get(name)
        if body is None:
            fdef = self._functions.get(name)
            direct, calls = set(), []
            for node in fdef.node_def if fdef is not None else ():
                direct.add(node.op)
                if node.op in self._functions:
                    calls.append(node.op)
                calls.extend(_attr_functions(node.attr.values()))
            body = self._bodies[name] = (frozenset(direct), tuple(calls))
        return body

    # -- the check ---------------------------------------------------------------------------------------------

    def check(self, ops, fed: frozenset[str]) -> None:
        """Raise PermissionDenied unless every state-changing op among ``ops`` (the ops a client graph runs, given
        the tensor names it feeds) belongs to a signature's subgraph, with only that signature's inputs fed
        upstream of it."""
        outside, misfed = [], None
        for op in ops:
            kinds = self.kinds(op)
            if not kinds:
                continue
            input_sets = self.allowed.get(op.name)
            if input_sets is None:
                outside.append((op, kinds))
            elif misfed is None:
                upstream = fed_upstream(op, fed)
                if not any(upstream <= inputs for inputs in input_sets):
                    misfed = op, kinds, upstream, input_sets
        if outside:
            outside.sort(key=lambda pair: pair[0].name)
            shown = ", ".join(_describe(op, kinds) for op, kinds in outside[:SHOWN])
            more = f" and {len(outside) - SHOWN} more" if len(outside) > SHOWN else ""
            if more:  # the types of those not named too
                more += f" (of types {', '.join(sorted({k for _, kinds in outside for k in kinds}))})"
            raise PermissionDenied(
                f"cannot run {'op' if len(outside) == 1 else 'ops'} {shown}{more}: "
                f"ops that change a model's variables or other shared state, or read or write files, run only as "
                f"part of one of the model's signatures, and {'this one is' if len(outside) == 1 else 'these are'} "
                f"in none; {ADMIN_HINT}"
            )
        if misfed is not None:
            op, kinds, upstream, input_sets = misfed
            raise PermissionDenied(
                f"cannot run {_describe(op, kinds)} with {', '.join(repr(n) for n in sorted(upstream))} fed: ops "
                f"that change a model's variables or other shared state, or read or write files, run only as part "
                f"of one of the model's signatures, fed only through that signature's inputs "
                f"({_inputs_text(input_sets)}); {ADMIN_HINT}"
            )


SHOWN = 3  # refused ops named in a message
ADMIN_HINT = (
    "served variables are changed through the admin API's AssignVariable (servex.v1.VariableService on --admin_port)"
)


def _describe(op, kinds: tuple[str, ...]) -> str:
    if kinds == (op.type,):
        return f"{op.name!r} (type {op.type})"
    return f"{op.name!r} (type {op.type}, calling functions that run {', '.join(kinds)})"


def _inputs_text(input_sets) -> str:
    texts = sorted({"[" + ", ".join(repr(n) for n in sorted(s)) + "]" for s in input_sets})
    return " or ".join(texts)


def _function_attrs(op_type: str) -> tuple[str, ...]:
    op_def = op_def_registry.get(op_type)
    if op_def is None:
        return ()
    return tuple(a.name for a in op_def.attr if a.type in ("func", "list(func)"))


def fed_upstream(op, fed: frozenset[str]) -> frozenset[str]:
    """The fed tensors (of ``fed``) whose values reach ``op``."""
    if not fed:
        return frozenset()
    seen, found = set(), set()
    stack = [op]
    while stack:
        current = stack.pop()
        if current.name in seen:
            continue
        seen.add(current.name)
        for t in current.inputs:
            if t.name in fed:
                found.add(t.name)
            else:
                stack.append(t.op)
        stack.extend(current.control_inputs)
    return frozenset(found)
