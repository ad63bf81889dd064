"""A version's second session, whose runs use one intra-op thread (loader/one_thread.py): it holds the same values
as the first (restored variables, tables from the init op, new values), and goes once no client graph uses it.

In this test process TensorFlow started without TF_OVERRIDE_GLOBAL_THREADPOOL, so both sessions share one pool here:
what is tested is what the second session holds; the daemon tests run it with a pool of its own."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from servex.loader import load_saved_model
from servex.loader.one_thread import PER_SESSION_POOLS
from servex.loader.variables import ON_DEVICE, UNRESTORED

TWO_THREADS = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=2, inter_op_parallelism_threads=2)


@pytest.fixture(scope="module")
def tabled(tmp_path_factory) -> str:
    """A TF2 export: variables a, b, c (float32[2] of 1, 2, 3); a vocabulary table from an asset file (its init op).
    ``ab``: x + sum(a) + sum(b); ``bc``: x + sum(b) + sum(c); ``word``: the word's id in the vocabulary + sum(c)."""
    root = tmp_path_factory.mktemp("tabled")
    vocab = root / "vocab.txt"
    vocab.write_text("zero\none\ntwo\nthree\n")
    module = tf.Module()
    module.a, module.b, module.c = (tf.Variable(tf.fill([2], float(i)), name=n) for i, n in enumerate("abc", 1))
    module.table = tf.lookup.StaticHashTable(
        tf.lookup.TextFileInitializer(str(vocab), tf.string, tf.lookup.TextFileIndex.WHOLE_LINE, tf.int64,
                                      tf.lookup.TextFileIndex.LINE_NUMBER), -1)  # fmt: skip
    spec = [tf.TensorSpec([None])]
    ab = tf.function(lambda x: {"y": x + tf.reduce_sum(module.a) + tf.reduce_sum(module.b)}, input_signature=spec)
    bc = tf.function(lambda x: {"y": x + tf.reduce_sum(module.b) + tf.reduce_sum(module.c)}, input_signature=spec)
    word = tf.function(
        lambda w: {"y": tf.cast(module.table.lookup(w), tf.float32) + tf.reduce_sum(module.c)},
        input_signature=[tf.TensorSpec([None], tf.string)],
    )
    path = root / "1"
    tf.saved_model.save(module, str(path), signatures={"ab": ab, "bc": bc, "word": word})
    vocab.unlink()  # the SavedModel's own copy (assets/) is what its init op reads
    return str(path)


def runner(model, session, signature: str):
    """A callable of ``signature``'s output on ``session``, taking its one input."""
    sig = model.signatures[signature]
    (spec,) = sig.inputs.values()
    options = config_pb2.CallableOptions(feed=[spec.name], fetch=[sig.outputs["y"].name])
    return session._make_callable_from_options(options)


def variable(model, letter: str) -> str:
    return next(n for n, r in model.variables.records.items() if r.key.startswith(f"{letter}/"))


def test_the_second_session_holds_what_the_first_does(tabled, monkeypatch):
    monkeypatch.setenv(PER_SESSION_POOLS, "1")
    model = load_saved_model(tabled, session_config=TWO_THREADS)
    try:
        store, twin = model.variables, model.one_thread
        x = np.array([0.5], np.float32)
        store.ensure([variable(model, "a"), variable(model, "b")]).result(30)  # as a client graph of ab would
        assert runner(model, model.session, "ab")(x)[0] == pytest.approx(6.5)
        assert store.state(variable(model, "c")) == UNRESTORED
        assert twin.available()
        second = twin.acquire()
        assert second is not None and second is not model.session and twin.acquire() is second  # shared
        assert runner(model, second, "ab")(x)[0] == pytest.approx(6.5)  # a and b copied from the checkpoint
        # c, restored after: into both sessions (before it, a run of bc would fail in either).
        store.ensure([variable(model, "c")]).result(30)
        assert store.state(variable(model, "c")) == ON_DEVICE
        assert runner(model, second, "bc")(x)[0] == pytest.approx(10.5)
        # The table, from the init op with the asset's path fed.
        words = np.array([b"two", b"nine"], object)
        np.testing.assert_array_equal(runner(model, second, "word")(words)[0], [8.0, 5.0])
        np.testing.assert_array_equal(runner(model, model.session, "word")(words)[0], [8.0, 5.0])
        # A new value goes to both.
        store.assign(variable(model, "b"), np.full(2, 10.0, np.float32))
        for session in (model.session, second):
            assert runner(model, session, "ab")(x)[0] == pytest.approx(22.5)
        # The last user gives it back: closed, and restores and new values go to the first alone.
        twin.release()
        assert len(store._sessions) == 2
        twin.release()
        assert store._sessions == [model.session]
        with pytest.raises(RuntimeError, match="closed"):
            second.run(model.signatures["ab"].outputs["y"].name, {model.signatures["ab"].inputs["x"].name: x})
        assert not twin.available() and twin.acquire() is None  # made once per version
        assert runner(model, model.session, "ab")(x)[0] == pytest.approx(22.5)
    finally:
        model.close()


def test_none_where_sessions_share_a_pool_or_the_first_has_one_thread(tabled, monkeypatch):
    monkeypatch.delenv(PER_SESSION_POOLS, raising=False)
    model = load_saved_model(tabled, session_config=TWO_THREADS)
    try:
        assert not model.one_thread.available()  # one pool per process: one thread per session is not to be had
    finally:
        model.close()
    monkeypatch.setenv(PER_SESSION_POOLS, "1")
    one = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1)
    model = load_saved_model(tabled, session_config=one)
    try:
        assert not model.one_thread.available()  # the first has one already
    finally:
        model.close()


def test_none_once_a_variable_was_given_a_new_value(tabled, monkeypatch):
    # A copy would come from the checkpoint, without the new value.
    monkeypatch.setenv(PER_SESSION_POOLS, "1")
    model = load_saved_model(tabled, session_config=TWO_THREADS)
    try:
        model.variables.assign(variable(model, "a"), np.full(2, 5.0, np.float32))
        assert model.one_thread.acquire() is None
        assert model.variables._sessions == [model.session]
    finally:
        model.close()


def test_unloading_the_version_closes_it(tabled, monkeypatch):
    monkeypatch.setenv(PER_SESSION_POOLS, "1")
    model = load_saved_model(tabled, session_config=TWO_THREADS)
    second = model.one_thread.acquire()
    model.close()
    with pytest.raises((RuntimeError, tf.errors.CancelledError), match="closed"):
        runner(model, second, "ab")
    assert model.one_thread.acquire() is None
