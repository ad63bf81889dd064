"""A version's XLA session (loader/xla.py): a copy of the graph whose signatures' function calls XLA compiles, holding
the same values as the first session; the served graph itself is never marked. No timing."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from servex.loader import load_saved_model
from tests.loader.test_one_thread import TWO_THREADS, runner, tabled, variable  # noqa: F401 (tabled: a fixture)
from tests.support.paths import HALF_PLUS_TWO_TF1

MARK = "_XlaMustCompile"


def test_the_xla_session_compiles_the_signatures_calls_over_a_copy_of_the_graph(tabled):  # noqa: F811
    model = load_saved_model(tabled, session_config=TWO_THREADS)
    try:
        twin = model.xla
        assert twin.available() and twin.calls
        for call in twin.calls:  # the signatures' function calls; none of the save and restore functions
            assert model.graph.get_operation_by_name(call).type == "StatefulPartitionedCall"
        assert not any("save" in model.graph.get_operation_by_name(c).get_attr("f").name for c in twin.calls)
        model.variables.ensure([variable(model, "a"), variable(model, "b")]).result()
        session = twin.acquire()
        assert session.graph is not model.graph
        assert session._config.intra_op_parallelism_threads == 1  # its programs run on one thread (loader/xla.py)
        for call in twin.calls:
            assert session.graph.get_operation_by_name(call).get_attr(MARK) is True
            with pytest.raises(ValueError):  # the served graph is not marked
                model.graph.get_operation_by_name(call).get_attr(MARK)
        x = np.array([1.0, 2.0], np.float32)
        expected = runner(model, model.session, "ab")(x)[0]
        np.testing.assert_allclose(runner(model, session, "ab")(x)[0], expected)  # a + b restored into it too
        np.testing.assert_allclose(expected, x + 2 + 4)
        # c is restored after: into both sessions; the table's init op ran in the copy too (by name), and its
        # lookup, which XLA cannot compile, fails there with TensorFlow's error (the client graph keeps its session)
        model.variables.ensure([variable(model, "c")]).result()
        np.testing.assert_allclose(runner(model, session, "bc")(x)[0], x + 4 + 6)
        with pytest.raises(tf.errors.OpError):
            runner(model, session, "word")(np.array([b"two"], object))
        assert runner(model, model.session, "word")(np.array([b"two"], object))[0].tolist() == [2.0 + 6]
        twin.release()
        assert twin._session is None and not twin.available()  # closed, and made once per version
    finally:
        model.close()


def test_a_tf1_graph_has_no_function_call_to_compile():
    model = load_saved_model(str(HALF_PLUS_TWO_TF1 / "00000123"), session_config=TWO_THREADS)
    try:
        assert not model.xla.calls and not model.xla.available()
    finally:
        model.close()
