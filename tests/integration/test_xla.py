"""XLA for a compute-bound TF2 graph of small ops, through the real daemon and the KServe v2 gRPC client, with
default flags: its lone runs try the function compiled (compiled off the requests' path, its answer checked), the
answers stay TensorFlow's own, and a bad index still gets TensorFlow's error (XLA would clamp it); under load its
batches, padded to a few sizes, run compiled too, in one-thread lanes."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tritonclient.grpc import service_pb2, service_pb2_grpc

from servex.executor.batching import program_rows
from servex.server.cores import usable_cores
from tests.support.models import save, tanh_loop

VOCAB = 50


@pytest.fixture(scope="module")
def embedding_loop_model(tmp_path_factory) -> Path:
    """int32 ``ids`` [None,16] -> an embedding (50 ids, 128 wide) averaged -> ``h`` [None,128] after 1,000 steps of
    h = tanh(h W + x): several milliseconds a row of ops too small to split, with a gather of the client's ids."""
    tf.random.set_seed(2)
    table = tf.Variable(tf.random.normal((VOCAB, 128), stddev=0.5))
    weights = tf.Variable(tf.random.normal((128, 128), stddev=0.05))

    class EmbeddingLoop(tf.Module):
        def __init__(self):
            super().__init__()
            self.table, self.weights = table, weights

        @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.int32, name="ids")])
        def serve(self, ids):
            x = tf.reduce_mean(tf.gather(self.table, ids), axis=1)
            return {"h": tanh_loop(x, self.weights)}

    base = tmp_path_factory.mktemp("embedding_loop") / "embedding_loop"
    module = EmbeddingLoop()
    save(module, base, serving_default=module.serve)
    return base


def infer_request(ids: np.ndarray) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name="embedding_loop")
    req.inputs.add(name="ids", datatype="INT32", shape=ids.shape)
    req.raw_input_contents.append(ids.astype(np.int32).tobytes())
    return req


@pytest.mark.skipif(usable_cores() < 2, reason="one core: every lone run stays on its worker's one thread")
def test_a_graph_of_small_ops_tries_xla_and_answers_as_tensorflow_does(start_daemon, embedding_loop_model):
    daemon = start_daemon("--model_name=embedding_loop", f"--model_base_path={embedding_loop_model}")
    stub = service_pb2_grpc.GRPCInferenceServiceStub(daemon.channel)
    rng = np.random.default_rng(5)
    inputs, answers, chosen = [], [], []

    def infer(rows: int = 1) -> None:
        ids = rng.integers(0, VOCAB, (rows, 16), dtype=np.int32)
        reply = stub.ModelInfer(infer_request(ids), timeout=60)
        inputs.append(ids)
        answers.append(np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(rows, 128))

    while not chosen and len(inputs) < 400:  # one request at a time until the choice is logged
        for _ in range(10):
            infer()
        chosen = [line for line in daemon.log().splitlines() if "runs on" in line and "client graph" in line]
    log_text = daemon.log()
    assert len(chosen) == 1, log_text[-3000:]
    # XLA was tried: its program compiled for the requests' shapes, then timed against the other modes (or dropped
    # at its first run slower than its worker's)
    assert "another session of the version made: its TF2 function calls compiled with XLA" in log_text
    assert "XLA compiled its program for feed shapes [1, 16]" in log_text, log_text[-3000:]
    assert "XLA's compiled program" in chosen[0] or "XLA's compiled program is slower" in log_text
    xla = "runs on XLA's compiled program" in chosen[0]

    # After the choice: more lone requests, one of two rows (new shapes: TensorFlow's kernels, compiled beside)
    for _ in range(10):
        infer()
    infer(rows=2)
    for _ in range(5):
        infer()

    # An id out of range: TensorFlow's own error, whichever mode the graph runs in (XLA would clamp the index)
    bad = np.zeros((1, 16), np.int32)
    bad[0, 3] = VOCAB
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(infer_request(bad), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"= {VOCAB} is not in [0, {VOCAB})" in caught.value.details()
    infer()  # and the graph serves on

    model = tf.saved_model.load(str(embedding_loop_model / "1")).signatures["serving_default"]
    for i in sorted({0, len(inputs) // 2, len(inputs) - 7, len(inputs) - 6, len(inputs) - 1}):
        expected = model(ids=tf.constant(inputs[i]))["h"].numpy()
        np.testing.assert_allclose(answers[i], expected, rtol=1e-4, atol=1e-5)
    log_text = daemon.log()
    if xla:  # the chosen program is kept; the one-thread session, not chosen, given back
        assert "session (its TF2 function calls compiled with XLA) closed" not in log_text
    else:  # not chosen: its session given back
        assert "session (its TF2 function calls compiled with XLA) closed" in log_text


@pytest.mark.skipif(usable_cores() < 2, reason="one core: every lone run stays on its worker's one thread")
def test_under_load_a_graph_on_xla_runs_its_batches_compiled_in_lanes(start_daemon, embedding_loop_model):
    daemon = start_daemon("--model_name=embedding_loop", f"--model_base_path={embedding_loop_model}")
    channel = daemon.channel
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    rng = np.random.default_rng(7)
    chosen: list[str] = []
    while not chosen:  # lone requests until the choice (1.2 ms a row compiled against 7.5 on its worker, here)
        for _ in range(10):
            stub.ModelInfer(infer_request(rng.integers(0, VOCAB, (1, 16), dtype=np.int32)), timeout=60)
        chosen = [line for line in daemon.log().splitlines() if "runs on" in line and "client graph" in line]
    assert "runs on XLA's compiled program" in chosen[0], daemon.log()[-3000:]

    sent = [rng.integers(0, VOCAB, (1, 16), dtype=np.int32) for _ in range(8 * 60)]
    answers: dict[int, np.ndarray] = {}

    def caller(first: int) -> None:  # 8 callers at once, one request in flight each: batches form
        for i in range(first, len(sent), 8):
            reply = stub.ModelInfer(infer_request(sent[i]), timeout=60)
            answers[i] = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(1, 128)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(caller, range(8)))
    log_text = daemon.log()
    # Batches are padded to a few sizes, each compiled once seen a few times (1-row requests only: no other shape)
    compiled = {int(m) for m in re.findall(r"XLA compiled its program for feed shapes \[(\d+), 16\]", log_text)}
    assert compiled - {1}, log_text[-3000:]
    assert compiled <= {program_rows(n, 32) for n in range(1, 33)}, compiled
    # Its runs keep one thread each: it runs in lanes, one per core
    assert re.search(r"compute-bound: batches of up to \d+ rows, up to \d+ runs at once, 1 intra-op thread", log_text)
    model = tf.saved_model.load(str(embedding_loop_model / "1")).signatures["serving_default"]
    expected = model(ids=tf.constant(np.concatenate(sent)))["h"].numpy()
    np.testing.assert_allclose(np.concatenate([answers[i] for i in range(len(sent))]), expected, rtol=1e-4, atol=1e-5)
