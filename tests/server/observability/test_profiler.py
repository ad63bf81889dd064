"""server/observability/profiler.py: tensorflow.ProfilerService served over real gRPC in this process, with
TensorFlow's own profiler recording servex's runs of half_plus_two (Predict, served beside it)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import grpc
import pytest
from tensorflow.tsl.profiler.protobuf import profiler_options_pb2, xplane_pb2
from tensorflow_serving.apis import prediction_service_pb2_grpc

from servex.protos.tensorflow import profiler_service_pb2 as pb
from servex.protos.tensorflow import profiler_service_pb2_grpc
from servex.server.observability import profiler
from servex.server.protocols.tfserving.grpc_api import PredictionService
from tests.support.clients import expect_error, predict_y
from tests.support.daemon import wait_for
from tests.support.in_process import aio_server, serving_core

MODEL = "hp"


@pytest.fixture(scope="module")
def served():
    """(channel, the ProfilerService): half_plus_two's Predict as ``hp`` and the profiler, on one gRPC server."""
    services = []

    def add(server):
        services.append(profiler.add_to_server(server))
        prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(
            PredictionService(core, False, 1 << 20), server
        )

    with serving_core(MODEL) as core, aio_server(add) as channel:
        yield channel, services[0]


@pytest.fixture
def stub(served):
    channel, service = served
    yield profiler_service_pb2_grpc.ProfilerServiceStub(channel)
    wait_for(lambda: service._capture is None, what="the capture to end")  # the next test's starts on its own


def _predicting(channel, until: Future, answered: list | None = None) -> threading.Thread:
    """A thread calling Predict until ``until`` is done (each answer appended to ``answered``)."""

    def loop():
        while not until.done():
            assert predict_y(channel, MODEL, [[1.0]]) == [2.5]
            if answered is not None:
                answered.append(1)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def _event_names(space) -> set[str]:
    names = set()
    for plane in space.planes:
        for line in plane.lines:
            names |= {plane.event_metadata[event.metadata_id].name for event in line.events}
    return names


def test_profile_writes_the_xspace_where_tensorflows_server_does(served, stub, tmp_path):
    channel, _ = served
    request = pb.ProfileRequest(duration_ms=1000, repository_root=str(tmp_path), session_id="2026_01_02_03_04_05",
                                host_name="127.0.0.1:8500", tools=["trace_viewer", "xplane.pb"])  # fmt: skip
    request.opts.duration_ms = 1000
    done = stub.Profile.future(request, timeout=60)
    _predicting(channel, done).join(60)
    response = done.result()
    assert not response.empty_trace
    assert not response.HasField("xspace")  # written, not returned
    written = tmp_path / "2026_01_02_03_04_05" / "127.0.0.1_8500.xplane.pb"  # TSL's name: ':' as '_'
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [written.name]
    space = xplane_pb2.XSpace.FromString(written.read_bytes())
    names = _event_names(space)
    # servex's runs show by their client graph's printed key: half_plus_two's serving_default feeds x, fetches y
    assert "x:0^y:0^" in names, sorted(names)[:50]


def test_emit_xspace_returns_it_and_opts_duration_is_read(stub):
    request = pb.ProfileRequest(emit_xspace=True, opts=profiler_options_pb2.ProfileOptions(duration_ms=50))
    response = stub.Profile(request, timeout=60)
    assert [plane.name for plane in response.xspace.planes if plane.name == "/host:CPU"] == ["/host:CPU"]


@pytest.mark.parametrize("duration_ms", [0, profiler.MAX_DURATION_MS + 1, 2**64 - 1])
def test_a_duration_out_of_range_is_invalid(stub, tmp_path, duration_ms):
    request = pb.ProfileRequest(duration_ms=duration_ms, repository_root=str(tmp_path), session_id="s")
    words = ["duration_ms", f"from 1 to {profiler.MAX_DURATION_MS} ms", f"got {duration_ms}"]
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, words, stub.Profile, request, timeout=30)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"session_id": "s"}, ["repository_root is empty"]),
        ({"session_id": "../up", "repository_root": "/tmp"}, ["session_id '../up' must be a file name"]),
        ({"session_id": "s", "host_name": "..", "repository_root": "/tmp"}, ["host_name '..' must be a file name"]),
    ],
)
def test_where_to_write_must_be_a_folder_and_file_names(stub, fields, words):
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, words, stub.Profile, pb.ProfileRequest(duration_ms=10, **fields))


def test_one_capture_at_a_time_and_terminate_ends_it(served, stub, tmp_path):
    channel, service = served
    first = pb.ProfileRequest(duration_ms=profiler.MAX_DURATION_MS, repository_root=str(tmp_path),
                              session_id="first", host_name="h")  # fmt: skip
    running = stub.Profile.future(first, timeout=120)
    wait_for(lambda: service._capture is not None, what="the first capture to start")
    second = pb.ProfileRequest(duration_ms=100, repository_root=str(tmp_path), session_id="second", host_name="h")
    words = ["a profile capture is running (session 'first'", "one capture at a time"]
    expect_error(grpc.StatusCode.UNAVAILABLE, words, stub.Profile, second, timeout=30)
    stub.Terminate(pb.TerminateRequest(session_id="other"), timeout=30)  # another session's: changes nothing
    assert not running.done()
    answered = []
    _predicting(channel, running, answered)
    wait_for(lambda: len(answered) >= 3, what="predictions during the capture")  # something to trace
    stub.Terminate(pb.TerminateRequest(session_id="first"), timeout=30)
    assert not running.result(timeout=60).empty_trace  # long before its 5 minutes
    assert (tmp_path / "first" / "h.xplane.pb").is_file()
    assert not (tmp_path / "second").exists()


def test_a_capture_the_client_left_frees_the_profiler(served, stub):
    _, service = served
    with pytest.raises(grpc.RpcError) as info:
        stub.Profile(pb.ProfileRequest(duration_ms=60_000, emit_xspace=True), timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: service._capture is None, what="the cancelled capture to end")
    assert stub.Profile(pb.ProfileRequest(duration_ms=10, emit_xspace=True), timeout=60).xspace.planes


def test_monitor_is_not_served_and_says_what_is(stub):
    expect_error(grpc.StatusCode.UNIMPLEMENTED, ["Monitor is not served", "Profile and Terminate are"],
                 stub.Monitor, pb.MonitorRequest(duration_ms=100), timeout=30)  # fmt: skip


def test_a_profiler_session_of_the_process_own_is_left_alone(stub, tmp_path):
    import tensorflow as tf

    tf.profiler.experimental.start(str(tmp_path / "theirs"))
    try:
        request = pb.ProfileRequest(duration_ms=10, repository_root=str(tmp_path / "ours"), session_id="s")
        expect_error(grpc.StatusCode.UNAVAILABLE, ["TensorFlow's profiler is recording already"], stub.Profile, request)
    finally:
        tf.profiler.experimental.stop()  # still theirs to stop: UnavailableError had servex stopped it
    assert list((tmp_path / "theirs").glob("plugins/profile/*/*.xplane.pb"))
    assert not (tmp_path / "ours").exists()
