"""Zero-copy on the CPU, checked by buffer address through real TensorFlow runs.

A ``tf.compat.v1.py_func`` probe records the address of the buffer TensorFlow hands to an op, in a session
callable made as executor/graph_executor.py makes them; and an identity SavedModel run through the real
GraphExecutor answers with TensorFlow's own output tensor, which aliases the fed buffer when nothing copied it.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from servex.executor import GraphExecutor
from servex.loader import load_saved_model
from servex.server.transport.tensors import to_ndarray
from servex.transfer import make_factory
from servex.transfer.cpu import ALIGNMENT, aligned_copy
from tests.support.buffers import BIG, address, unaligned


@pytest.fixture(scope="module")
def probe():
    """A session callable ``x -> 0`` whose op records the address of the buffer it was given for ``x``."""
    seen: list[int] = []

    def record(x):
        seen.append(address(x))
        return np.int64(0)

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, None, name="x")
        tf.compat.v1.py_func(record, [x], tf.int64, stateful=True, name="probe")
    session = tf.compat.v1.Session(graph=graph)
    options = config_pb2.CallableOptions(feed=["x:0"], fetch=["probe:0"])
    options.run_options.inter_op_thread_pool = -1  # as GraphExecutor builds them with run_in_caller_thread
    run = session._make_callable_from_options(options)

    def seen_by_tensorflow(array: np.ndarray) -> int:
        seen.clear()
        run(array)
        return seen[0]

    yield seen_by_tensorflow
    session.close()


def test_tensorflow_takes_an_aligned_array_without_a_copy(probe):
    array = aligned_copy(np.arange(1000, dtype=np.float32))
    assert probe(array) == address(array)
    fed = make_factory("cpu").transfer([array])[0]
    assert fed is array
    assert probe(fed) == address(array)


def test_tensorflow_copies_an_unaligned_array_itself(probe):
    """What the CPU executor relies on: TensorFlow copies inputs not aligned to 64 bytes (TF_NewTensor)."""
    small = unaligned(1000)
    assert probe(small) != address(small)
    assert make_factory("cpu").transfer([small])[0] is small  # small: left to TensorFlow's copy


@pytest.mark.parametrize(
    "make",
    [lambda: unaligned(BIG), lambda: np.arange(2 * BIG, dtype=np.float32)[::2]],
    ids=["unaligned", "strided"],
)
def test_a_large_unaligned_array_is_copied_once_by_the_executor_and_never_by_tensorflow(probe, make):
    array = make()
    fed = make_factory("cpu").transfer([array])[0]
    assert address(fed) != address(array)
    assert probe(fed) == address(fed)  # TensorFlow took the executor's copy as it is: one copy in all


def test_a_decoded_tensor_content_input_reaches_tensorflow_with_at_most_one_copy(probe):
    proto = tf.make_tensor_proto(np.arange(4 * BIG, dtype=np.float32))
    decoded = to_ndarray(proto, "x")
    fed = make_factory("cpu").transfer([decoded])[0]
    assert address(fed) % ALIGNMENT == 0
    assert probe(fed) == address(fed)
    np.testing.assert_array_equal(fed, np.arange(4 * BIG, dtype=np.float32))


@pytest.fixture(scope="module")
def identity(tmp_path_factory):
    """A TF1 SavedModel whose serving signature returns its input: ``x`` -> ``y`` = identity(x)."""
    path = tmp_path_factory.mktemp("identity") / "1"
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as session:
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        y = tf.identity(x, name="y")
        tf.compat.v1.saved_model.simple_save(session, str(path), {"x": x}, {"y": y})
    executor = GraphExecutor(load_saved_model(str(path)), transfer=make_factory("cpu"))
    yield executor
    executor.close()


def test_through_the_graph_executor_an_aligned_input_is_never_copied(identity):
    array = aligned_copy(np.arange(1000, dtype=np.float32))
    (out,) = identity.run({"x:0": array}, ["y:0"])
    np.testing.assert_array_equal(out, array)
    assert address(out) == address(array)  # TensorFlow's output is the very buffer servex fed


def test_through_the_graph_executor_a_large_unaligned_input_is_copied_once_aligned(identity):
    array = unaligned(BIG)
    (out,) = identity.run({"x:0": array}, ["y:0"])
    np.testing.assert_array_equal(out, array)
    assert address(out) != address(array) and address(out) % ALIGNMENT == 0
