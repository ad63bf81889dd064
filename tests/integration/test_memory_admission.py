"""Memory-aware admission with the real daemon: in a memory-limited cgroup, a flood of requests whose answers are
eight times their size (a model that tiles its input) is answered OK or RESOURCE_EXHAUSTED, call by call, and the
daemon lives with its memory under the limit. Without admission the same flood gets it killed (shown by hand:
``--max_memory_bytes`` far above the cgroup's limit). Where no cgroup can be made, ``--max_memory_bytes`` stands in
for it and the daemon's own resident memory is watched."""

from __future__ import annotations

import os
import socket
import threading
from collections import Counter

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from tests.support.cgroups import memory_cgroup
from tests.support.daemon import Daemon, metric

pytestmark = pytest.mark.integration

LIMIT = 1 << 30
WIDTH = 65536  # floats in a row: 256 KiB in, 2 MiB out
ROWS = 8
CALLERS = 16
CALLS = 10  # each caller's


@pytest.fixture(scope="module")
def tile_model(tmp_path_factory):
    module = tf.Module()
    module.f = tf.function(
        lambda x: {"y": tf.tile(x, [1, 8])}, input_signature=[tf.TensorSpec([None, WIDTH], tf.float32, name="x")]
    )
    base = tmp_path_factory.mktemp("tile")
    tf.saved_model.save(module, str(base / "1"), signatures={"serving_default": module.f})
    return base


def _request(rows: int) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "tile"
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones((rows, WIDTH), np.float32)))
    return request


def _anon_bytes(pid: int) -> int:
    """A process's resident memory less its shared file pages (what a cgroup cannot take back)."""
    with open(f"/proc/{pid}/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")


def _flood(daemon: Daemon) -> tuple[Counter, dict[str, set[str]], int]:
    """CALLERS threads, each with its own connection, each sending CALLS requests; the answers' codes, the
    messages of each code, and the most memory the daemon held meanwhile."""
    codes, messages, peak, done, lock = Counter(), {}, [0], threading.Event(), threading.Lock()
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    request = _request(ROWS)

    def caller():
        with grpc.insecure_channel(daemon.address, options=options) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            for _ in range(CALLS):
                try:
                    answer = stub.Predict(request, timeout=120)
                    assert answer.outputs["y"].tensor_shape.dim[1].size == 8 * WIDTH
                    code, message = "OK", ""
                except grpc.RpcError as e:
                    code, message = e.code().name, e.details()
                with lock:
                    codes[code] += 1
                    messages.setdefault(code, set()).add(message)

    def sample():
        while not done.wait(0.02):
            try:
                peak[0] = max(peak[0], _anon_bytes(daemon.proc.pid))
            except OSError:
                return

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=caller) for _ in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    sampler.join()
    return codes, messages, peak[0]


def test_a_flood_past_the_memory_limit_is_answered_and_the_daemon_lives(tile_model, tmp_path):
    with memory_cgroup(LIMIT) as cgroup:
        # JSON bodies up to 256 MiB (a quarter of the message limit): the memory limit is what refuses the REST call
        args = ["--model_name=tile", f"--model_base_path={tile_model}", f"--max_message_bytes={LIMIT}"]
        if cgroup is None:  # no cgroup here: servex's own limit, and its own memory watched
            args.append(f"--max_memory_bytes={LIMIT}")
        daemon = Daemon(args, tmp_path, rest=True, prefix=cgroup.prefix if cgroup else ())
        try:
            daemon.wait_serving()
            assert "memory: admitting work against" in daemon.log()
            codes, messages, peak = _flood(daemon)
            assert daemon.proc.poll() is None, daemon.log()[-3000:]
            assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, (codes, messages)
            assert codes["OK"] > 0 and codes["RESOURCE_EXHAUSTED"] > 0, codes
            assert sum(codes.values()) == CALLERS * CALLS
            # Refused as work that needs more memory than is left, or as a message never received for want of it
            # (executor/memory.py, server/transport/reception.py): each names the limit and where it comes from.
            source = "the cgroup's memory limit" if cgroup else "--max_memory_bytes"
            for refused in messages["RESOURCE_EXHAUSTED"]:
                assert "needs about" in refused or "the request was not received" in refused, refused
                assert "the memory limit of 1.0 GiB" in refused and source in refused, refused
            assert any("needs about" in refused for refused in messages["RESOURCE_EXHAUSTED"]), messages
            assert peak < LIMIT, f"the daemon held {peak} bytes, over the limit of {LIMIT}"
            if cgroup is not None:
                assert cgroup.oom_kills() == 0
            assert metric(daemon, "servex_memory_limit_bytes") == LIMIT
            # Every refusal the daemon counted answered a call, but for its trials (a faster way to run the graph,
            # not tried for want of memory), which refuse no call.
            refused = metric(daemon, "servex_memory_refused_total")
            assert refused - metric(daemon, "servex_memory_refused_total", what="trial") == codes["RESOURCE_EXHAUSTED"]

            # Everyone else is served once the flood is over, and what it was admitted with was given back.
            stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
            answer = stub.Predict(_request(1), timeout=60)
            assert np.all(tf.make_ndarray(answer.outputs["y"]) == 1.0)
            assert metric(daemon, "servex_memory_admitted_bytes") == 0

            # A REST body too large for the memory left is refused from its Content-Length, before it is read.
            with socket.create_connection(("127.0.0.1", daemon.rest_port), timeout=30) as sock:
                sock.sendall(b"POST /v1/models/tile:predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 200000000\r\n\r\n{\"instances\": [")  # fmt: skip
                answer = b""  # all of it: servex ends the connection after a 429 (aiohttp 3.10 writes the headers
                while chunk := sock.recv(65536):  # and the body apart)
                    answer += chunk
            answer = answer.decode()
            assert answer.startswith("HTTP/1.1 429"), answer
            assert "a body of 200000000 bytes needs about" in answer, answer
        finally:
            daemon.stop()


def test_max_memory_bytes_replaces_the_cgroup_limit(tmp_path):
    """A limit below what the daemon holds refuses every call, naming the flag; health and metadata still answer."""
    from tests.conftest import HALF_PLUS_TWO_TF1

    daemon = Daemon([f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=hp", "--max_memory_bytes=1000000"],
                    tmp_path, spare=True)  # fmt: skip
    try:
        daemon.wait_serving()
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "hp"
        request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([1.0, 2.0], np.float32)))
        stub = prediction_service_pb2_grpc.PredictionServiceStub(daemon.channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Predict(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the memory limit of 976.6 KiB, from --max_memory_bytes" in refused.value.details()
        assert metric(daemon, "servex_memory_limit_bytes") == 1_000_000
    finally:
        daemon.stop()
