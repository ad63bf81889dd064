"""The chaos soak's faults on the servex side (scripts/chaos_soak.py): serving processes killed with SIGKILL, and
the checkpoint of a lazily restored model broken while it serves (removed, truncated, unreadable, failing with EIO
through tests/support/faults.c preloaded into servex). Each opens its window in the run's ``Tally`` before it
strikes (scripts/chaos_outcomes.py) and records what it checks afterwards: the group serves again, the model's
calls succeed again once its file is back."""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from chaos_outcomes import Tally
from prometheus_client.parser import text_string_to_metric_families
from soak_traffic import predict
from tensorflow_serving.apis import prediction_service_pb2_grpc

from tests.support import faults
from tests.support.daemon import Daemon
from tests.support.processes import children

TABLES = "tables"  # the model the storage faults break: signature sig_k (serving_default for k = 0) is x * v_k
SIGNATURES = 24
STORAGE_FAULTS = ("removed", "truncated", "unreadable", "eio")
RECOVERY_S = 300  # a serving process's replacement imports TensorFlow and loads every model on a busy machine


def one_connection(address: str, *options) -> grpc.Channel:
    """A channel of its own connection: the kernel hands each new connection to one of the serving processes."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1), *options])


class Group:
    """The servex process group under test (--serving_processes): its serving processes and its /metrics."""

    def __init__(self, daemon: Daemon, processes: int):
        self.daemon, self.processes = daemon, processes

    def workers(self) -> list[int]:
        return children(self.daemon.proc.pid)

    def samples(self, name: str):
        url = f"http://127.0.0.1:{self.daemon.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]

    def metric(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.samples(name) if all(s.labels.get(k) == v for k, v in labels.items()))

    def serving(self) -> int:
        try:
            return int(self.metric("servex_serving_processes", state="serving"))
        except OSError:
            return -1

    def wait_serving(self, stop: threading.Event | None = None, timeout: float = RECOVERY_S) -> bool:
        """Until every serving process serves (False after ``timeout``, at ``stop``, or when servex is gone)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.daemon.proc.poll() is None:
            if self.serving() == self.processes:
                return True
            if stop is not None and stop.is_set():
                return False
            time.sleep(0.5)
        return False


def kill(group: Group, tally: Tally, rng: random.Random, stop: threading.Event) -> None:
    """SIGKILL one serving process at random, then wait for its replacement to serve."""
    workers = group.workers()
    if not workers:
        return
    victim = rng.choice(workers)
    window = tally.open("kill", time.monotonic())
    try:
        os.kill(victim, signal.SIGKILL)
    except ProcessLookupError:
        pass
    tally.close(window, time.monotonic())
    if not group.wait_serving(stop) and not stop.is_set():
        tally.fail(f"kill: {group.processes} processes not serving again {RECOVERY_S} s after pid {victim} was killed")


def make_tables(path: Path) -> None:
    """The model the storage faults break: variable v_k = [k+1, k+1, k+1] read by signature sig_k (x: [None, 3])
    alone, so that each signature's first call reads its own variable."""
    import tensorflow as tf

    module = tf.Module()
    module.tables = [tf.Variable(np.full(3, k + 1, np.float32), name=f"v_{k}") for k in range(SIGNATURES)]

    def signature(variable):
        return tf.function(lambda x: {"y": x * variable}, input_signature=[tf.TensorSpec([None, 3], tf.float32)])

    signatures = {("serving_default" if k == 0 else f"sig_{k}"): signature(v) for k, v in enumerate(module.tables)}
    tf.saved_model.save(module, str(path), signatures=signatures)


def tables_call(stub, k: int, timeout: float = 30) -> str:
    """Predict of sig_k: ``ok`` when y = k + 1; the INTERNAL a broken checkpoint answers as ``unexpected INTERNAL
    reading v_k from the checkpoint`` when it names the variable and the data file."""
    request = predict(TABLES, "x", np.ones((1, 3), np.float32))
    request.model_spec.signature_name = f"sig_{k}" if k else ""
    try:
        reply = stub.Predict(request, timeout=timeout)
    except grpc.RpcError as e:
        details = e.details() or ""
        if e.code() == grpc.StatusCode.INTERNAL and f"'v_{k}'" in details and "variables.data-" in details:
            return f"unexpected INTERNAL reading v_{k} from the checkpoint"
        return f"unexpected {e.code().name}: {details[:200]}"
    y = reply.outputs["y"]
    values = np.frombuffer(y.tensor_content, np.float32) if y.tensor_content else np.array(y.float_val, np.float32)
    return "ok" if values.tolist() == [k + 1.0] * 3 else f"unexpected answer {values.tolist()} (expected {k + 1})"


class Storage:
    """The ``tables`` model's versions (``base``/N) and the faults of the served one's data file. Each episode
    publishes a new version (all its variables unread), waits until every serving process has loaded it and read
    v_0 (--prefetch_variables), breaks its data file for a few seconds, puts it back, and checks every signature
    over fresh connections: each must serve again at once."""

    def __init__(self, work: Path):
        self.base = work / "chaos-tables"
        self.staging = work / "tables-staging"
        shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.base.mkdir(parents=True)
        self.saved = work / "tables-data"
        make_tables(self.base / "1")
        self.version = 1
        self.shim = faults.build(work)
        self.switch = faults.Switch(f"{self.base.name}/")  # every file of the model's: its checkpoint's and more

    def environment(self) -> dict[str, str]:
        """For servex's start: the shim preloaded, watching this model's files."""
        return self.switch.environment(self.shim)

    def data_file(self, version: int) -> Path:
        return next((self.base / str(version) / "variables").glob("variables.data-*"))

    def publish(self) -> int:
        """Version N+1, a copy of N put in place whole (a rename), so that no poll sees it half-copied."""
        new = self.version + 1
        shutil.rmtree(self.staging, ignore_errors=True)
        shutil.copytree(self.base / str(self.version), self.staging)
        self.staging.rename(self.base / str(new))
        self.version = new
        for old in self.base.iterdir():
            if old.name.isdigit() and int(old.name) < new - 1:
                shutil.rmtree(old, ignore_errors=True)
        return new

    def loads(self, group: Group, version: int) -> float:
        path = str(self.base / str(version))
        count = "servex_model_load_seconds_count"
        return sum(s.value for s in group.samples(count) if s.labels.get("model_path", "").rstrip("/") == path)

    def episode(self, group: Group, tally: Tally, rng: random.Random, stop: threading.Event) -> None:
        version = self.publish()
        deadline = time.monotonic() + 120
        while self.loads(group, version) < group.processes:
            if stop.is_set():
                return
            if time.monotonic() > deadline:
                tally.fail(f"storage: version {version} of {TABLES} not loaded by every serving process in 120 s")
                return
            time.sleep(0.2)
        self.probe(group, tally, [0], connections=8)  # v_0 read in every process (prefetched, and read here)
        kind = rng.choice(STORAGE_FAULTS)
        data = self.data_file(version)
        shutil.copyfile(data, self.saved)
        put_back = lambda: shutil.copyfile(self.saved, data)  # noqa: E731
        undo = {
            "removed": (data.unlink, put_back),
            "truncated": (lambda: data.write_bytes(self.saved.read_bytes()[:8]), put_back),
            "unreadable": (lambda: self.switch.on("eacces"), lambda: self.switch.off("eacces")),
            "eio": (lambda: self.switch.on("eio"), lambda: self.switch.off("eio")),
        }
        fault, fix = undo[kind]
        window = tally.open("storage", time.monotonic(), kind)
        try:
            fault()
            stop.wait(rng.uniform(3, 8))
        finally:
            fix()
            tally.close(window, time.monotonic())
        self.probe(group, tally, range(SIGNATURES), connections=4)

    def probe(self, group: Group, tally: Tally, signatures, connections: int) -> None:
        """Every signature in ``signatures`` over each of ``connections`` fresh connections: calls that must
        succeed (``tables_probe``)."""
        for _ in range(connections):
            channel = one_connection(group.daemon.address)
            try:
                stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
                for k in signatures:
                    start = time.monotonic()
                    tally.record("tables_probe", tables_call(stub, k), start, time.monotonic())
            finally:
                channel.close()
