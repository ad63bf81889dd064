"""--serving_processes with real processes and clients: a serving process killed under load fails only the calls
it was running and is replaced, the supervisor's /metrics saying so; one whose replacements keep dying is started
again after a growing wait while the other serves on; a supervisor killed takes its serving processes with it."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from tensorflow_serving.apis import prediction_service_pb2_grpc

from tests.support.clients import predict_request, predict_y, y
from tests.support.daemon import Daemon, metric, model_config_file, wait_for
from tests.support.paths import HALF_PLUS_TWO_TF1
from tests.support.processes import children, describe, environment, established_on, gone

pytestmark = pytest.mark.integration

THREADS = 4  # client threads of each kind, each with one call in flight at a time over its own connection
START_S = 180  # generous: a serving process imports TensorFlow and loads the model on a busy 2-core machine
FAILURES = ("UNAVAILABLE", "CANCELLED")  # what a call sees when the process running it dies


def _group(tmp_path: Path, *flags: str) -> Daemon:
    daemon = Daemon([*flags, "--serving_processes=2"], tmp_path)
    daemon.wait_serving(START_S)
    _wait_serving(daemon, 2)
    return daemon


def _wait_serving(daemon: Daemon, n: int) -> None:
    """Until the supervisor's /metrics counts ``n`` serving processes."""
    wait_for(lambda: metric(daemon, "servex_serving_processes", state="serving") == n, START_S, f"{n} serving")


def _one_connection(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


class Load:
    """Predict calls of half_plus_two from THREADS threads, one after another until stopped, each thread over its
    own channel; each call recorded as (its thread, its end, its outcome: OK, a status code's name, or WRONG for a
    wrong answer). With ``wait_for_ready``, a call waits for its channel to connect instead of failing at once
    while the channel is in its reconnect backoff (gRPC's wait-for-ready)."""

    def __init__(self, address: str, wait_for_ready: bool):
        self.calls: list[tuple[int, float, str]] = []
        self.wait_for_ready = wait_for_ready
        self.stopped = threading.Event()
        self.channels = [_one_connection(address) for _ in range(THREADS)]
        self.threads = [threading.Thread(target=self._calls, args=(i,), daemon=True) for i in range(THREADS)]
        for thread in self.threads:
            thread.start()

    def _calls(self, index: int) -> None:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(self.channels[index])
        request = predict_request("half", np.asarray([[1.0], [2.0]], np.float32))
        while not self.stopped.is_set():
            try:
                reply = stub.Predict(request, timeout=30, wait_for_ready=self.wait_for_ready)
                outcome = "OK" if y(reply) == [2.5, 3.0] else "WRONG"
            except grpc.RpcError as e:
                outcome = e.code().name
            self.calls.append((index, time.monotonic(), outcome))

    def succeeded_since(self, since: float) -> int:
        return sum(1 for _, end, outcome in list(self.calls) if outcome == "OK" and end >= since)

    def failed(self, since: float) -> list[tuple[int, float, str]]:
        """The calls that failed, each as (its thread, seconds from ``since`` to its end, its outcome)."""
        return [(i, end - since, outcome) for i, end, outcome in list(self.calls) if outcome != "OK"]

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(60)
        for channel in self.channels:
            channel.close()


def test_a_killed_serving_process_fails_only_its_calls_and_is_replaced(tmp_path):
    daemon = _group(tmp_path, f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=half")
    try:
        first = children(daemon.proc.pid)
        # Clients that ride out a reconnection (wait-for-ready), and clients with gRPC's defaults, whose channel
        # may fail calls at once for its reconnect backoff (about 1 s) when its new connection went to the dying
        # process's listeners (docs/processes.md).
        loads = [Load(daemon.address, wait_for_ready=True), Load(daemon.address, wait_for_ready=False)]
        try:
            for load in loads:
                wait_for(lambda load=load: load.succeeded_since(0) >= 50, 60, "calls from every thread")
            # the victim: a serving process that runs calls of the load (holds some of its connections)
            victim = wait_for(lambda: next((p for p in first if established_on(p, daemon.port)), None), 30, "victim")
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            replacement = wait_for(lambda: next(iter(set(children(daemon.proc.pid)) - set(first)), 0), 60, "new pid")
            _wait_serving(daemon, 2)
            served_at = time.monotonic()
            for load in loads:
                wait_for(lambda load=load: load.succeeded_since(served_at) >= 50, 60, "calls after it served")
        finally:
            for load in loads:
                load.stop()
        failed = [call for load in loads for call in load.failed(killed_at)]
        # only calls at the kill, and only as a lost connection fails them
        assert all(outcome in FAILURES and 0 <= t <= served_at - killed_at for _, t, outcome in failed), failed
        riding_out = loads[0].failed(killed_at)
        # only as the connection broke: the call in flight on it, and the few started before the channel saw it
        # break (gRPC picks the broken connection until its state changes: 3 such calls in 0.5 ms were seen), never
        # during the reconnection, which wait-for-ready rides out
        for thread in range(THREADS):
            ends = [t for i, t, _ in riding_out if i == thread]
            assert len(ends) <= 5 and (not ends or max(ends) - min(ends) < 0.5), riding_out
        assert metric(daemon, "servex_serving_process_restarts_total", reason="signal") == 1
        assert metric(daemon, "servex_serving_processes", state="backoff") == 0
        log = daemon.log()
        assert f"(pid {victim}) was killed by SIGKILL after serving" in log, log
        assert f"pid {replacement} replaces pid {victim}" in log, log
        # the replacement serves: fresh connections land on either process, and every call is answered
        channels = [_one_connection(daemon.address) for _ in range(16)]
        try:
            for i, channel in enumerate(channels):
                assert predict_y(channel, "half", [[2.0 * i]], timeout=30) == [i + 2.0]
            assert established_on(replacement, daemon.port) > 0
        finally:
            for channel in channels:
                channel.close()
    finally:
        daemon.stop()


def test_a_slot_whose_processes_keep_dying_is_started_again_after_growing_waits(tmp_path):
    config = model_config_file(tmp_path, {"half": HALF_PLUS_TWO_TF1})
    daemon = _group(tmp_path, f"--model_config_file={config}")
    try:
        good = config.read_text()
        config.write_text("model_config_list { config {")  # read once at start: only new processes see it
        victim, survivor = children(daemon.proc.pid)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: "never serving: starting another in 4 s" in daemon.log(), START_S, "a second failed start")
        log = daemon.log()
        assert "was killed by SIGKILL after serving" in log and "starting another in 1 s" in log, log
        assert "exited with 1 after never serving: starting another in 2 s" in log, log
        assert metric(daemon, "servex_serving_process_restarts_total", reason="exit") >= 2
        assert metric(daemon, "servex_serving_processes", state="serving") == 1
        assert predict_y(daemon.channel, "half", [[2.0]], timeout=30) == [3.0]  # the other one serves on
        assert children(daemon.proc.pid)[0] == survivor
        config.write_text(good)
        _wait_serving(daemon, 2)  # the next start succeeds
    finally:
        daemon.stop()


def test_a_killed_supervisor_takes_its_serving_processes_with_it(tmp_path):
    daemon = _group(tmp_path, f"--model_base_path={HALF_PLUS_TWO_TF1}", "--model_name=half")
    workers = children(daemon.proc.pid)
    assert len(workers) == 2
    metrics_dir = Path(environment(workers[0])["PROMETHEUS_MULTIPROC_DIR"])
    assert metrics_dir.is_dir()
    daemon.proc.kill()
    daemon.proc.wait(30)
    deadline = time.monotonic() + 20  # no call in flight: each drains at once
    while not all(gone(pid) for pid in workers):
        assert time.monotonic() < deadline, {pid: describe(pid) for pid in workers}
        time.sleep(0.1)
    assert not metrics_dir.exists()  # the last one removed the folder the supervisor left
    daemon.stop()
