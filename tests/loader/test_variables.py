"""The restore registry, the loaded-variable registry and a version's variable store (real TensorFlow)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

from servex.executor import GraphExecutor
from servex.loader import load_saved_model
from servex.loader.errors import InvalidArgument, NotFound, ServingError
from servex.loader.variables import (
    ON_DEVICE,
    RESTORE_POOL,
    UNRESTORED,
    AlreadyExists,
    LoadedVariableRegistry,
    RestoreRegistry,
)
from tests.conftest import HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2, REPO


def test_register_is_idempotent_for_an_equal_spec_and_refuses_another():
    registry = RestoreRegistry(lambda names: None)
    first = registry.register("w", np.float32, (2, 3))
    assert registry.register("w", np.dtype("float32"), [2, 3]) is first
    with pytest.raises(AlreadyExists) as info:
        registry.register("w", np.float64, (2, 3))
    assert info.value.code == "ALREADY_EXISTS"
    assert "float32[2, 3]" in info.value.message and "float64[2, 3]" in info.value.message
    with pytest.raises(AlreadyExists, match=r"float32\[3, 2\]"):
        registry.register("w", np.float32, (3, 2))
    with pytest.raises(NotFound, match="'nope'"):
        registry.restore(["nope"])


def test_concurrent_restores_read_each_variable_once_and_together():
    reads, timed = [], []
    gate = threading.Event()

    def read(names):
        reads.append(sorted(names))
        gate.wait(5)

    registry = RestoreRegistry(read, lambda entries, seconds: timed.append(([e.name for e in entries], seconds)))
    for name in "uvw":
        registry.register(name, np.float32, (2, 3))
    assert registry.state("w") == UNRESTORED
    first = RESTORE_POOL.submit(registry.restore, ["w", "v"])
    while not reads:  # the first caller is reading w and v
        threading.Event().wait(0.001)
    assert registry.state("w") == "RESTORING" and registry.state("u") == UNRESTORED
    others = [RESTORE_POOL.submit(registry.restore, ["v", "w"]) for _ in range(6)]
    gate.set()
    for f in [first, *others]:
        f.result(10).result(10)
    assert reads == [["v", "w"]]  # one read, of both, by the first caller; the others shared it
    registry.restore(["u", "v"]).result(10)
    assert reads == [["v", "w"], ["u"]]  # v was read already
    assert [names for names, _ in timed] == [["w", "v"], ["u"]] and all(seconds > 0 for _, seconds in timed)
    assert {registry.state(n) for n in "uvw"} == {"RESTORED"}
    assert registry.restore([]).result(0) is None


def failing_once(calls: list):
    """A read or placement that records its calls and fails the first one."""

    def call(names):
        calls.append(names)
        if len(calls) == 1:
            raise OSError("disk went away")

    return call


def test_a_failed_read_is_reported_and_the_next_caller_reads_again():
    attempts = []
    registry = RestoreRegistry(failing_once(attempts))
    registry.register("w", np.float32, (2,))
    with pytest.raises(OSError, match="disk went away"):
        registry.restore(["w"]).result()
    assert registry.state("w") == UNRESTORED
    registry.restore(["w", "w"]).result()  # a name listed twice is read once
    assert attempts == [["w"], ["w"]] and registry.state("w") == "RESTORED"


def test_loaded_variable_registry_places_once_per_device_in_one_call_per_batch():
    calls = []
    registry = LoadedVariableRegistry()
    futures = [f for _ in range(5) for f in registry.place(["w", "v"], "cpu", lambda names: calls.append(names))]
    futures += registry.place(["w"], "gpu:0", lambda names: calls.append(["gpu", *names]))
    for f in futures:
        f.result(10)
    assert sorted(calls) == [["gpu", "w"], ["w", "v"]]
    assert registry.placed("w", "cpu") and registry.placed("w", "gpu:0") and not registry.placed("u", "cpu")


def test_a_failed_placement_is_tried_again():
    calls = []
    place = failing_once(calls)
    registry = LoadedVariableRegistry()
    (failed,) = registry.place(["w"], "cpu", place)
    with pytest.raises(OSError):
        failed.result(10)
    assert not registry.placed("w", "cpu")
    (retried,) = registry.place(["w"], "cpu", place)
    retried.result(10)
    assert registry.placed("w", "cpu") and calls == [["w"], ["w"]]


@pytest.mark.parametrize("path", [HALF_PLUS_TWO_TF1, HALF_PLUS_TWO_TF2], ids=["tf1", "tf2"])
def test_store_restores_lazily_and_assigns(path):
    model = load_saved_model(str(path / "00000123"))
    try:
        store = model.variables
        assert {state for _, state in store.listing()} == {UNRESTORED}
        ready = store.ensure(["a"])
        ready.result(30)
        assert store.state("a") == ON_DEVICE and store.state("b") == UNRESTORED
        assert store.ensure(["a"]) is None  # already there
        store.assign("a", np.float32(4.0))
        sig = model.signatures["serving_default"]
        x = np.ones((1, 1) if path == HALF_PLUS_TWO_TF1 else (1,), np.float32)
        y = GraphExecutor(model).run({sig.inputs["x"].name: x}, [sig.outputs["y"].name])[0]
        assert y.ravel().tolist() == [6.0]  # a * x + b, with a replaced
        with pytest.raises(InvalidArgument, match=r"float32\[\].*float64\[\]"):
            store.assign("a", np.float64(1.0))
        with pytest.raises(NotFound, match="'zz'"):
            store.assign("zz", np.float32(1.0))
    finally:
        model.close()


def test_eager_restore_puts_everything_on_the_device():
    model = load_saved_model(str(HALF_PLUS_TWO_TF1 / "00000123"), lazy_restore=False)
    try:
        assert {state for _, state in model.variables.listing()} == {ON_DEVICE}
        model.variables.assign("a", np.float32(4.0))  # a TF1 ref variable, its Assign fed in place of the read
        sig = model.signatures["serving_default"]
        y = GraphExecutor(model).run({sig.inputs["x"].name: np.ones((1, 1), np.float32)}, [sig.outputs["y"].name])
        assert y[0].ravel().tolist() == [6.0]  # a * x + b, with a replaced and b as read
    finally:
        model.close()


# Each step in a fresh process, so that no memory freed by earlier tests (TensorFlow keeps some) hides a copy.
EXPORT_TABLE = """
import sys
import numpy as np
import tensorflow as tf
module = tf.Module()
module.table = tf.Variable(np.arange(ROWS * 64, dtype=np.float32).reshape(ROWS, 64), name="table")
module.f = tf.function(
    lambda ids: {"rows": tf.nn.embedding_lookup(module.table, ids)}, input_signature=[tf.TensorSpec([None], tf.int64)]
)
tf.saved_model.save(module, sys.argv[1], signatures={"serving_default": module.f})
"""
MEASURE_TABLE = """
import json, sys
import numpy as np
from servex.executor import GraphExecutor
from servex.loader import load_saved_model

def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

model = load_saved_model(sys.argv[1])
sig = model.signatures["serving_default"]
loaded = rss()
rows = GraphExecutor(model).run({sig.inputs["ids"].name: np.array([0, ROWS - 1])}, [sig.outputs["rows"].name])[0]
first = rss()
print(json.dumps({"grown": first - loaded, "rows": rows[:, :2].tolist()}))
"""


def test_an_embedding_table_is_held_once_after_its_first_lookup(tmp_path):
    """Restored inside TensorFlow, the table's one buffer is the variable's own. Fed from Python (as until
    2026-11-24), the first sparse read (an embedding lookup) copied it and the fed buffer stayed: twice the
    table."""
    rows = 262_144  # 64 MiB of float32
    path = str(tmp_path / "1")
    for script, arg in ((EXPORT_TABLE, path), (MEASURE_TABLE, path)):
        done = subprocess.run(
            [sys.executable, "-c", script.replace("ROWS", str(rows)), arg],
            cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    table = rows * 64 * 4
    assert result["rows"] == [[0.0, 1.0], [(rows - 1) * 64.0, (rows - 1) * 64.0 + 1]]  # the checkpoint's values
    assert table * 0.9 < result["grown"] < table * 1.5, result["grown"]


def test_a_checkpoint_broken_after_the_load_fails_the_run_clearly_and_a_repaired_one_serves(tmp_path):
    version = tmp_path / "1"
    shutil.copytree(HALF_PLUS_TWO_TF2 / "00000123", version, copy_function=shutil.copyfile)
    (data,) = (version / "variables").glob("variables.data-*")
    good = data.read_bytes()
    model = load_saved_model(str(version))  # lazily: the data is not read yet
    try:
        sig = model.signatures["serving_default"]
        executor = GraphExecutor(model)
        data.write_bytes(b"")  # the file breaks under the loaded version
        with pytest.raises(ServingError) as info:
            executor.run({sig.inputs["x"].name: np.ones(1, np.float32)}, [sig.outputs["y"].name])
        assert info.value.code == "INTERNAL"
        assert info.value.message.startswith("reading variable(s) 'a', 'b' from the checkpoint failed: ")
        assert "Detected at node" not in info.value.message and "File " not in info.value.message
        assert {state for _, state in model.variables.listing()} == {UNRESTORED}
        data.write_bytes(good)  # repaired: the next run reads it
        y = executor.run({sig.inputs["x"].name: np.full(1, 2.0, np.float32)}, [sig.outputs["y"].name])[0]
        assert y.tolist() == [3.0]  # 0.5 * 2 + 2
    finally:
        model.close()


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> str:
    """A TF2 export of variables a, b, c (float32[2], each 1.0, 2.0, 3.0 twice); signature ``ab``: x + sum(a) +
    sum(b), ``bc``: x + sum(b) + sum(c)."""
    path = str(tmp_path_factory.mktemp("three") / "1")
    module = tf.Module()
    module.a, module.b, module.c = (tf.Variable(tf.fill([2], float(i)), name=n) for i, n in enumerate("abc", 1))
    spec = [tf.TensorSpec([None])]
    ab = tf.function(lambda x: {"y": x + tf.reduce_sum(module.a) + tf.reduce_sum(module.b)}, input_signature=spec)
    bc = tf.function(lambda x: {"y": x + tf.reduce_sum(module.b) + tf.reduce_sum(module.c)}, input_signature=spec)
    tf.saved_model.save(module, path, signatures={"ab": ab, "bc": bc})
    return path


class RecordingSession:
    """The session, with the targets of each run recorded."""

    def __init__(self, session):
        self.session, self.runs = session, []

    def run(self, fetches, feed_dict=None):
        self.runs.append(fetches)
        return self.session.run(fetches, feed_dict)


def reads_of(model, targets) -> list:
    """The RestoreV2 ops whose outputs the assigns ``targets`` assign."""
    return sorted({model.graph.get_operation_by_name(t).inputs[1].op.name for t in targets})


def y(model, signature: str) -> float:
    sig = model.signatures[signature]
    return GraphExecutor(model).run({sig.inputs["x"].name: np.zeros(1, np.float32)}, [sig.outputs["y"].name])[0][0]


def servex_ops(model, op_type: str) -> list:
    return [op for op in model.graph.get_operations() if op.name.startswith("servex_restore") and op.type == op_type]


def test_a_signature_s_variables_are_read_by_one_restore_op_and_no_others(three):
    model = load_saved_model(three)
    try:
        store = model.variables
        a, b, c = (next(n for n, r in store.records.items() if r.key.startswith(f"{v}/")) for v in "abc")
        # A read per variable, one per signature's pair; no placeholder: a new value is fed in place of the read.
        assert sorted(len(op.outputs) for op in servex_ops(model, "RestoreV2")) == [1, 1, 1, 2, 2]
        assert servex_ops(model, "Placeholder") == []
        session = store._sessions[0] = RecordingSession(store._sessions[0])
        assert y(model, "ab") == 6.0
        (targets,) = session.runs
        (read,) = reads_of(model, targets)  # one RestoreV2, of a and b only
        assert len(model.graph.get_operation_by_name(read).outputs) == 2
        assert store.state(a) == store.state(b) == ON_DEVICE and store.state(c) == UNRESTORED
        store.assign(b, np.full(2, 10.0, np.float32))
        assert y(model, "bc") == 26.0  # b keeps its new value: only c was read
        (targets,) = session.runs[2:]  # [1] was the assign
        assert [model.graph.get_operation_by_name(t).inputs[0].op.name for t in targets] == [c]
        assert len(model.graph.get_operation_by_name(reads_of(model, targets)[0]).outputs) == 1
        assert store.ensure([a]) is None and store.ensure([a, b]) is None
    finally:
        model.close()


def test_a_part_of_a_group_is_read_alone(three):
    model = load_saved_model(three)
    try:
        store = model.variables
        a, b = (next(n for n, r in store.records.items() if r.key.startswith(f"{v}/")) for v in "ab")
        session = store._sessions[0] = RecordingSession(store._sessions[0])
        store.ensure([a]).result(30)
        (targets,) = session.runs
        assert len(targets) == 1 and len(model.graph.get_operation_by_name(reads_of(model, targets)[0]).outputs) == 1
        assert store.state(b) == UNRESTORED
        assert y(model, "ab") == 6.0  # b then alone too: the pair's read would read a again
        assert len(session.runs[1]) == 1 and reads_of(model, session.runs[1]) != reads_of(model, targets)
    finally:
        model.close()


def test_an_eager_load_reads_every_variable_in_one_restore_op_and_assigns_one(three):
    model = load_saved_model(three, lazy_restore=False)
    try:
        store = model.variables
        (read,) = servex_ops(model, "RestoreV2")
        assert len(read.outputs) == 3 and servex_ops(model, "Placeholder") == []
        assert {state for _, state in store.listing()} == {ON_DEVICE}
        b = next(n for n, r in store.records.items() if r.key.startswith("b/"))
        store.assign(b, np.full(2, 10.0, np.float32))  # fed in place of the shared read's output
        assert (y(model, "ab"), y(model, "bc")) == (22.0, 26.0)
        with pytest.raises(InvalidArgument, match=r"float32\[2\].*float32\[3\]"):
            store.assign(b, np.zeros(3, np.float32))
    finally:
        model.close()
