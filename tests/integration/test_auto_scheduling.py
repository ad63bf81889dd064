"""servex's default scheduling on a compute-bound model, through the real daemon and the KServe v2 gRPC client:
one request's run spreads over every core servex may use, and concurrent requests run in batches, two batches at
a time. The thread CPU times come from /proc (Linux), read around the calls: no timing is asserted."""

from __future__ import annotations

import concurrent.futures
import os
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tritonclient.grpc import service_pb2, service_pb2_grpc

from servex.executor.cost_model import COMPUTE_BOUND_RUNS
from servex.executor.thread_modes import ONE_THREAD_BUSY, POOL_BUSY_SHARE, ThreadModeChooser
from servex.server.cores import usable_cores
from tests.support.daemon import metric
from tests.support.models import save, tanh_loop

IMAGE = (96, 96, 64)
# Lone runs until a compute-bound graph's thread mode is chosen: each of the three modes (its worker, the inter-op
# pool, the one-thread session) warmed and tried, and the first runs that build, restore and classify it.
CHOSEN = 3 * (ThreadModeChooser.WARM + ThreadModeChooser.TRIALS) + 2


@pytest.fixture(scope="module")
def conv_model(tmp_path_factory) -> Path:
    """A small convolution network (random weights): float32 ``images`` [None,96,96,64] -> ``features``
    [None,64]; a run of one image is about a hundred milliseconds of convolutions on one core."""
    tf.random.set_seed(0)
    filters = [tf.Variable(tf.random.normal((3, 3, 64, 64), stddev=0.05)) for _ in range(6)]

    class Conv(tf.Module):
        def __init__(self):
            super().__init__()
            self.filters = filters

        @tf.function(input_signature=[tf.TensorSpec([None, *IMAGE], tf.float32, name="images")])
        def serve(self, images):
            h = images
            for f in self.filters:
                h = tf.nn.relu(tf.nn.conv2d(h, f, strides=1, padding="SAME"))
            return {"features": tf.reduce_mean(h, axis=[1, 2])}

    base = tmp_path_factory.mktemp("conv") / "conv"
    module = Conv()
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.serve})
    return base


def request(seed: int) -> service_pb2.ModelInferRequest:
    image = np.random.default_rng(seed).random((1, *IMAGE), dtype=np.float32)
    req = service_pb2.ModelInferRequest(model_name="conv")
    tensor = req.inputs.add(name="images", datatype="FP32", shape=image.shape)
    del tensor  # the shape and name are set; the bytes go in raw_input_contents
    req.raw_input_contents.append(image.tobytes())
    return req


def thread_cpu_times(pid: int) -> dict[int, int]:
    """Each thread's CPU time: in nanoseconds from schedstat where the kernel keeps it, else user + system time
    in clock ticks (stat fields 14 and 15: whole ticks, so a thread's few milliseconds may read as one)."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "schedstat").exists():
                times[int(task.name)] = int((task / "schedstat").read_text().split()[0])
            else:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                times[int(task.name)] = int(fields[11]) + int(fields[12])
        except (OSError, IndexError):
            continue  # the thread ended
    return times


def busy_threads(daemon, stub, calls: int = 10) -> int:
    """How many of the daemon's threads did a real share of the CPU work of one request (the median over ``calls``
    requests, one at a time: successive requests may run on different run workers)."""
    for i in range(CHOSEN):
        stub.ModelInfer(request(i), timeout=60)
    counts = []
    for i in range(calls):
        before = thread_cpu_times(daemon.proc.pid)
        stub.ModelInfer(request(i), timeout=60)
        after = thread_cpu_times(daemon.proc.pid)
        spent = {t: after[t] - before.get(t, 0) for t in after}
        total = sum(spent.values())
        if total > 0:
            counts.append(sum(1 for cpu in spent.values() if cpu >= 0.2 * total))
    assert len(counts) > calls // 2, "the requests took no measurable CPU time"
    return sorted(counts)[len(counts) // 2]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread CPU times come from Linux's /proc")
def test_one_request_of_a_compute_bound_model_runs_on_every_core(start_daemon, conv_model):
    cores = usable_cores()
    # spare=False: no spare servex imports TensorFlow beside the measured runs (tests/support/daemon.py)
    daemon = start_daemon("--model_name=conv", f"--model_base_path={conv_model}", "--xla=false", spare=False)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(daemon.channel)
    assert busy_threads(daemon, stub) >= min(cores, 2)
    if cores > 1:  # its lone runs' modes were tried; one thread only where its worker's runs left cores idle
        (chosen,) = [line for line in daemon.log().splitlines() if "runs on" in line and "client graph" in line]
        busy = float(re.search(r"kept ([0-9.]+) cores busy", chosen).group(1))
        assert 0 < busy <= cores + 0.5
        # tried: timed beside the others, or dropped after its first runs, much slower
        tried = "one intra-op thread" in chosen or "one intra-op thread is slower" in daemon.log()
        assert tried == (busy < ONE_THREAD_BUSY)
        # the inter-op pool too, only where they left a fifth of the cores idle
        assert ("TensorFlow's inter-op pool" in chosen) == (busy < POOL_BUSY_SHARE * cores), chosen
    labels = {"model": "conv", "version": "1", "signature": "serving_default"}
    assert metric(daemon, "servex_scheduler_compute_bound", **labels) == 1
    assert metric(daemon, "servex_scheduler_concurrency", **labels) == COMPUTE_BOUND_RUNS
    assert metric(daemon, "servex_scheduler_intra_op_threads", **labels) == cores

    # Under load, its requests run in batches (two at a time, each spread over every core).
    before = metric(daemon, "servex_batch_size_count", model="conv")
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: stub.ModelInfer(request(i), timeout=120), range(48)))
    assert all(list(a.outputs[0].shape) == [1, 64] for a in answers)
    requests = metric(daemon, "servex_batch_size_count", model="conv") - before
    alone = metric(daemon, "servex_batch_size_bucket", model="conv", le="1.0")
    assert requests == 48 and alone < metric(daemon, "servex_batch_size_count", model="conv")
    # Batched and alone, the answers agree with TensorFlow's own, row by row.
    model = tf.saved_model.load(str(conv_model / "1")).signatures["serving_default"]
    for i in (0, 7, 47):
        expected = model(images=tf.constant(np.frombuffer(request(i).raw_input_contents[0], np.float32)
                                            .reshape(1, *IMAGE)))["features"].numpy()  # fmt: skip
        got = np.frombuffer(answers[i].raw_output_contents[0], np.float32).reshape(1, 64)
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread CPU times come from Linux's /proc")
@pytest.mark.skipif(usable_cores() < 2, reason="one core: nothing to tell apart")
def test_with_one_thread_in_each_tensorflow_pool_the_same_request_runs_on_one_thread(start_daemon, conv_model):
    one_thread = ("--tensorflow_intra_op_parallelism=1", "--tensorflow_inter_op_parallelism=1")
    daemon = start_daemon("--model_name=conv", f"--model_base_path={conv_model}", *one_thread, "--xla=false",
                          spare=False)  # fmt: skip
    stub = service_pb2_grpc.GRPCInferenceServiceStub(daemon.channel)
    assert busy_threads(daemon, stub) == 1


def test_runs_at_once_of_a_compute_bound_model_follow_the_flag(start_daemon, conv_model):
    # --auto_compute_bound_runs=1: one batch at a time, each on every core (recurrent graphs of tiny ops may serve
    # more so); the choice says so, and concurrent requests still batch.
    daemon = start_daemon("--model_name=conv", f"--model_base_path={conv_model}", "--auto_compute_bound_runs=1",
                          "--num_run_workers=2", "--xla=false")  # fmt: skip
    stub = service_pb2_grpc.GRPCInferenceServiceStub(daemon.channel)
    for i in range(CHOSEN):
        stub.ModelInfer(request(i), timeout=60)
    labels = {"model": "conv", "version": "1", "signature": "serving_default"}
    assert metric(daemon, "servex_scheduler_compute_bound", **labels) == 1
    assert metric(daemon, "servex_scheduler_concurrency", **labels) == 1
    before = metric(daemon, "servex_batch_size_count", model="conv")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: stub.ModelInfer(request(i), timeout=120), range(24)))
    assert all(list(a.outputs[0].shape) == [1, 64] for a in answers)
    assert metric(daemon, "servex_batch_size_count", model="conv") - before == 24
    assert metric(daemon, "servex_batch_size_bucket", model="conv", le="1.0") < metric(
        daemon, "servex_batch_size_count", model="conv"
    )


@pytest.fixture(scope="module")
def loop_model(tmp_path_factory) -> Path:
    """A graph of many small ops (random weights): float32 ``x`` [None,128] -> ``h`` [None,128], 1,000 steps of
    h = tanh(h W + x); a run of one row is several milliseconds of ops too small to split over threads (well
    above thread_modes' small graph, which stays on its worker untried: 300 steps took 2.3 ms, and a run below
    2 ms on a faster machine ended the trial)."""
    tf.random.set_seed(1)
    weights = tf.Variable(tf.random.normal((128, 128), stddev=0.05))

    class Loop(tf.Module):
        def __init__(self):
            super().__init__()
            self.weights = weights

        @tf.function(input_signature=[tf.TensorSpec([None, 128], tf.float32, name="x")])
        def serve(self, x):
            return {"h": tanh_loop(x, self.weights)}

    base = tmp_path_factory.mktemp("loop") / "loop"
    module = Loop()
    save(module, base, serving_default=module.serve)
    return base


@pytest.mark.skipif(usable_cores() < 2, reason="one core: no second session to try")
def test_a_graph_of_small_ops_tries_one_thread_in_a_second_session(start_daemon, loop_model):
    # Its lone runs leave the cores idle: servex makes the version's one-thread session and tries it; whichever mode
    # wins, the answers are TensorFlow's own and the gauge says the threads its runs use. (XLA: the next test.)
    daemon = start_daemon("--model_name=loop", f"--model_base_path={loop_model}", "--xla=false")
    stub = service_pb2_grpc.GRPCInferenceServiceStub(daemon.channel)
    rng = np.random.default_rng(3)
    inputs, answers, chosen = [], [], []

    def infer() -> None:
        x = rng.random((1, 128), dtype=np.float32)
        req = service_pb2.ModelInferRequest(model_name="loop")
        req.inputs.add(name="x", datatype="FP32", shape=x.shape)
        req.raw_input_contents.append(x.tobytes())
        inputs.append(x)
        answers.append(np.frombuffer(stub.ModelInfer(req, timeout=60).raw_output_contents[0], np.float32))

    while not chosen and len(inputs) < 400:  # one request at a time until the choice is logged
        for _ in range(10):
            infer()
        chosen = [line for line in daemon.log().splitlines() if "runs on" in line and "client graph" in line]
    for _ in range(10):  # after it
        infer()
    log_text = daemon.log()
    # Tried: a time in the chosen line, or its first runs much slower than the worker's best (a noisy host's
    # worker can run one fast, and one thread is then left after two runs).
    lines = log_text.splitlines()
    dropped = any("one intra-op thread is slower" in line and "not tried further" in line for line in lines)
    assert len(chosen) == 1 and ("one intra-op thread" in chosen[0] or dropped), log_text[-3000:]
    assert "XLA" not in log_text  # --xla=false: never tried
    assert "another session of the version made: its runs use one intra-op thread" in log_text
    one_thread = "runs on one intra-op thread" in chosen[0]
    assert one_thread != ("session (its runs use one intra-op thread) closed" in log_text)  # kept, or given back
    labels = {"model": "loop", "version": "1", "signature": "serving_default"}
    if metric(daemon, "servex_scheduler_compute_bound", **labels) == 1:  # its choice made (after 8 runs)
        assert metric(daemon, "servex_scheduler_intra_op_threads", **labels) == (1 if one_thread else usable_cores())
    model = tf.saved_model.load(str(loop_model / "1")).signatures["serving_default"]
    for i in (0, len(inputs) // 2, len(inputs) - 1):  # in the trial, in either session, and after it
        np.testing.assert_allclose(answers[i], model(x=tf.constant(inputs[i]))["h"].numpy()[0], rtol=1e-4, atol=1e-5)
