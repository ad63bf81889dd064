"""Priorities, deadlines, the queue bound and dynamic batching through the real daemon and real clients."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import tensorflow as tf

from tests.support.clients import predict_first, predict_outputs
from tests.support.daemon import metric, wait_for
from tests.support.paths import EXPECTED, HALF_PLUS_TWO_TF1


def test_batched_callers_each_get_their_own_rows(start_daemon):
    daemon = start_daemon(f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=hp",
                          f"--batching_parameters_file={EXPECTED / 'batching_config.txt'}")  # fmt: skip
    errors, wrong = [], []

    def caller(i):
        channel = grpc.insecure_channel(daemon.address)
        for j in range(25):
            x = np.array([[i * 100.0 + j], [-i - j]], np.float32)
            try:
                y = predict_first(channel, "hp", {"x": x})
                if not np.array_equal(y, 0.5 * x + 2):
                    wrong.append((x, y))
            except grpc.RpcError as e:
                errors.append(e)
        channel.close()

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and wrong == []
    assert metric(daemon, "servex_batch_size_count", model="hp", signature="serving_default") == 16 * 25
    assert metric(daemon, "servex_queue_wait_seconds_count", model="hp", priority="0") == 16 * 25
    assert metric(daemon, "servex_run_seconds_count", model="hp", version="123") == 16 * 25


def test_mixed_priorities_paced_and_batched_each_caller_gets_its_own_rows(start_daemon):
    """A high-priority caller beside low-priority ones: the lows are paced by the event loop (the default) and
    batched; every answer is still the caller's own. The loop's lag is sampled on /metrics."""
    daemon = start_daemon(f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=hp", "--enable_batching",
                          "--lower_priority_burst=2")  # fmt: skip
    errors, wrong = [], []

    def caller(i, priority):
        channel = grpc.insecure_channel(daemon.address)
        for j in range(20):
            x = np.array([[i * 100.0 + j]], np.float32)
            try:
                y = predict_first(channel, "hp", {"x": x}, priority=priority)
                if not np.array_equal(y, 0.5 * x + 2):
                    wrong.append((x, y))
            except grpc.RpcError as e:
                errors.append(e)
        channel.close()

    threads = [threading.Thread(target=caller, args=(i, 10 if i == 0 else 0)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and wrong == []
    assert metric(daemon, "servex_requests_total", model="hp", priority="10", code="OK") == 20
    assert metric(daemon, "servex_requests_total", model="hp", priority="0", code="OK") == 7 * 20
    time.sleep(1.2)  # two lag samples at least (every 0.5 s)
    assert metric(daemon, "servex_event_loop_lag_seconds_count") >= 2


def test_priority_metadata_must_be_an_integer(half_daemon):
    with pytest.raises(grpc.RpcError) as info:
        predict_first(half_daemon.channel, "half", {"x": np.ones((1, 1), np.float32)}, priority="high")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "x-servex-priority" in info.value.details()


@pytest.fixture(scope="module")
def one_worker(start_daemon, slow_model):
    return start_daemon(f"--model_base_path={slow_model}", "--model_name=slow", "--num_run_workers=1",
                        "--max_queued_requests=3", "--priority_aging_ms=0", "--xla=false")  # fmt: skip


def _hold_the_worker(daemon, seconds_of_work=600_000):
    """A long run that keeps the single worker busy; returns the thread that waits for it."""

    def call():
        channel = grpc.insecure_channel(daemon.address)
        predict_first(channel, "slow", {"iterations": np.array(seconds_of_work, np.int64)}, timeout=60)
        channel.close()

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)
    return thread


def test_expired_requests_never_run_and_priorities_order_the_queue(one_worker):
    daemon = one_worker
    expired_before = metric(daemon, "servex_deadline_exceeded_total", model="slow")
    holder = _hold_the_worker(daemon)
    with pytest.raises(grpc.RpcError) as info:
        predict_first(daemon.channel, "slow", {"iterations": np.array(1, np.int64)}, timeout=0.2)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    done = []

    def call(label, priority):  # each queued run takes a while, so the order they ran in shows in when they end
        channel = grpc.insecure_channel(daemon.address)
        predict_first(channel, "slow", {"iterations": np.array(200_000, np.int64)}, priority=priority)
        done.append(label)
        channel.close()

    low = threading.Thread(target=call, args=("low", -5))
    low.start()
    time.sleep(0.1)
    high = threading.Thread(target=call, args=("high", 7))
    high.start()
    for t in (holder, low, high):
        t.join(60)
    assert done == ["high", "low"]
    assert metric(daemon, "servex_deadline_exceeded_total", model="slow") == expired_before + 1


def test_a_full_queue_answers_resource_exhausted(one_worker):
    daemon = one_worker
    holder = _hold_the_worker(daemon)
    ten = {"iterations": np.array(10, np.int64)}
    queued = [threading.Thread(target=predict_first, args=(grpc.insecure_channel(daemon.address), "slow", ten))
              for _ in range(3)]  # fmt: skip
    for t in queued:
        t.start()
    time.sleep(0.2)
    with pytest.raises(grpc.RpcError) as info:
        predict_first(daemon.channel, "slow", {"iterations": np.array(10, np.int64)})
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queued" in info.value.details()
    for t in (holder, *queued):
        t.join(60)
    assert predict_first(daemon.channel, "slow", {"iterations": np.array(3, np.int64)}) == 3


def test_queued_input_bytes_over_the_bound_answer_resource_exhausted(start_daemon, slow_model):
    daemon = start_daemon(f"--model_base_path={slow_model}", "--model_name=slow", "--num_run_workers=1",
                          "--max_queued_bytes=12")  # fmt: skip
    holder = _hold_the_worker(daemon)  # running, not queued
    queued = threading.Thread(target=predict_first, args=(grpc.insecure_channel(daemon.address), "slow",
                                                          {"iterations": np.array(10, np.int64)}))  # fmt: skip
    queued.start()  # 8 bytes queued
    time.sleep(0.2)
    with pytest.raises(grpc.RpcError) as info:  # 8 more would make 16
        predict_first(daemon.channel, "slow", {"iterations": np.array(10, np.int64)})
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "hold 8 bytes" in info.value.details() and "--max_queued_bytes" in info.value.details()
    for t in (holder, queued):
        t.join(60)
    assert predict_first(daemon.channel, "slow", {"iterations": np.array(3, np.int64)}) == 3


def test_a_call_whose_deadline_passes_while_it_runs_is_counted_deadline_exceeded(one_worker):
    # gRPC answers the client DEADLINE_EXCEEDED at the deadline, while the run goes on; servex counts the call so
    # (it used to count it OK once the run ended).
    daemon = one_worker
    before = {code: metric(daemon, "servex_requests_total", model="slow", code=code)
              for code in ("OK", "DEADLINE_EXCEEDED")}  # fmt: skip
    with pytest.raises(grpc.RpcError) as info:
        predict_first(daemon.channel, "slow", {"iterations": np.array(600_000, np.int64)}, timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert predict_first(daemon.channel, "slow", {"iterations": np.array(3, np.int64)}) == 3  # after the long run
    assert metric(daemon, "servex_requests_total", model="slow", code="DEADLINE_EXCEEDED") == (
        before["DEADLINE_EXCEEDED"] + 1
    )
    assert metric(daemon, "servex_requests_total", model="slow", code="OK") == before["OK"] + 1  # the short call


def test_a_stream_whose_deadline_passes_while_it_runs_is_counted_deadline_exceeded(one_worker):
    from tritonclient.grpc import service_pb2

    daemon = one_worker
    before = metric(daemon, "servex_requests_total", method="ModelStreamInfer", code="DEADLINE_EXCEEDED")
    request = service_pb2.ModelInferRequest(model_name="slow")
    request.inputs.add(name="iterations", datatype="INT64", shape=[])
    request.raw_input_contents.append(np.array(600_000, np.int64).tobytes())
    stream = daemon.channel.stream_stream(
        "/inference.GRPCInferenceService/ModelStreamInfer",
        request_serializer=service_pb2.ModelInferRequest.SerializeToString,
        response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stream(iter([request]), timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert predict_first(daemon.channel, "slow", {"iterations": np.array(3, np.int64)}) == 3  # after the long run
    assert metric(daemon, "servex_requests_total", method="ModelStreamInfer", code="DEADLINE_EXCEEDED") == before + 1


def test_the_timeout_parameter_bounds_the_wait_to_run_not_the_run(one_worker):
    # Triton's timeout (microseconds the request may wait to run): 0.3 s, and a run of about 1.5 s that starts at
    # once. The run is answered, not dropped for having ended after the timeout.
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    daemon = one_worker
    request = service_pb2.ModelInferRequest(model_name="slow")
    request.inputs.add(name="iterations", datatype="INT64", shape=[])
    request.raw_input_contents.append(np.array(600_000, np.int64).tobytes())
    request.parameters["timeout"].int64_param = 300_000
    reply = service_pb2_grpc.GRPCInferenceServiceStub(daemon.channel).ModelInfer(request, timeout=30)
    assert np.frombuffer(reply.raw_output_contents[0], np.int64).tolist() == [600_000]


@pytest.fixture(scope="module")
def sequences_model(tmp_path_factory):
    """``serving_default``: tokens [None,None] float32 -> doubled (same shape) and length (the length each row was
    run at, int32 [None]); ``hold``: a while loop of ``iterations`` steps, to keep the one worker busy."""

    class Sequences(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32, name="tokens")])
        def serve(self, tokens):
            return {"doubled": tokens * 2.0, "length": tf.fill([tf.shape(tokens)[0]], tf.shape(tokens)[1])}

        @tf.function(input_signature=[tf.TensorSpec([], tf.int64, name="iterations")])
        def hold(self, iterations):
            return {"count": tf.while_loop(lambda i: i < iterations, lambda i: i + 1, [tf.constant(0, tf.int64)])[0]}

    base = tmp_path_factory.mktemp("sequences")
    module = Sequences()
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.serve, "hold": module.hold})
    return base


def test_pad_variable_length_inputs_batches_callers_of_other_lengths(start_daemon, sequences_model, tmp_path):
    """TensorFlow Serving's pad_variable_length_inputs: requests queued behind a long run, with sequences of other
    lengths, run as one batch padded to the longest, each with its own first value; every caller gets its own rows
    at the padded length, as from TensorFlow Serving. A sequence whose length would take the padded batch past
    --max_message_bytes runs in a batch of its own."""
    params = tmp_path / "batching.txt"
    params.write_text("max_batch_size { value: 8 }\npad_variable_length_inputs: true\n")
    daemon = start_daemon(f"--model_base_path={sequences_model}", "--model_name=seq", "--num_run_workers=1",
                          f"--batching_parameters_file={params}", "--max_message_bytes=8192")  # fmt: skip

    def call(signature, alias, value):  # from its own thread: the channel is shared
        return predict_outputs(daemon.channel, "seq", {alias: value}, timeout=60, signature=signature)

    long = np.arange(1, 601, dtype=np.float32)[None]  # 2,400 bytes; padded with the 4 rows below: 12,000
    sequences = [np.array([[1, 2]], np.float32), np.array([[3, 4, 5, 6], [7, 8, 9, 10]], np.float32),
                 np.array([[11]], np.float32), long]  # fmt: skip
    answers = {}

    def caller(i):
        answers[i] = call("serving_default", "tokens", sequences[i])

    holder = threading.Thread(target=call, args=("hold", "iterations", np.array(1_200_000, np.int64)))
    holder.start()
    wait_for(lambda: metric(daemon, "servex_queue_wait_seconds_count", model="seq", signature="hold") == 1,
             what="the long run to start")  # fmt: skip
    callers = []
    for i in range(len(sequences)):  # one at a time, so that they queue in this order
        callers.append(threading.Thread(target=caller, args=(i,)))
        callers[-1].start()
        wait_for(lambda i=i: metric(daemon, "servex_queue_depth", model="seq") == i + 1, what=f"caller {i} queued")
    assert holder.is_alive(), "the long run ended before the callers queued behind it"
    for t in (holder, *callers):
        t.join(60)
    np.testing.assert_array_equal(answers[0]["doubled"], [[2, 4, 2, 2]])
    np.testing.assert_array_equal(answers[1]["doubled"], sequences[1] * 2)
    np.testing.assert_array_equal(answers[2]["doubled"], [[22, 22, 22, 22]])
    np.testing.assert_array_equal(answers[3]["doubled"], long * 2)
    # One run of the three short ones at the longest of them; the long one on its own.
    assert [answers[i]["length"].tolist() for i in range(4)] == [[4], [4, 4], [4], [600]]
    assert metric(daemon, "servex_batch_size_sum", model="seq", signature="serving_default") == 3 * 3 + 1
    # Alone, a caller is run at its own length.
    assert call("serving_default", "tokens", sequences[0])["doubled"].tolist() == [[2, 4]]
