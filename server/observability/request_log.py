"""Request logging, as TensorFlow Serving's ``logging_config`` does it: a model's sampled calls become
``PredictionLog`` records (tensorflow_serving/apis/prediction_log.proto) in TFRecord files.

What TensorFlow Serving does (tensorflow_serving/core/server_request_logger.cc, request_logger.cc), and so what this
does:

- One ``RequestLogger`` per distinct logging config; models with the same config share it, and a config reload
  keeps the logger of a config that did not change (its files, its queue). A model whose config is gone or changed
  stops logging there at once; a logger no model uses any more writes what it has queued and closes its file.
- Each call is sampled uniformly at random with probability ``sampling_config.sampling_rate`` (0 logs nothing, 1
  every call), decided before anything else is done for the record.
- A record is ``PredictionLog{log_metadata, <kind>_log{request, response}}``: the call's request and response
  messages, and a LogMetadata with the ``model_spec`` of the answer (name, version, signature_name; for
  MultiInference the model and version, each task's signature being in its result), the configured
  ``sampling_config``, ``saved_model_tags`` (``serve``, the tags servex loads) and ``timestamp_secs``.

Unlike TensorFlow Serving, whose open-source model server has no log collector registered (a ``logging_config``
there fails the config load), servex writes the records itself (collector type ``tfrecord``): to
``<filename_prefix>-<pid>-<n>.tfrecord``, ``n`` counting from 00000 in each process (names that exist are skipped),
a file closed and the next one started once it holds ``MAX_FILE_BYTES`` or more (records are never split).

Nothing waits on the files: a sampled call's record is queued (at most ``QUEUE_RECORDS`` waiting per logger) for the
logger's writer thread, which builds and serializes it and writes it out, flushing after each batch, so a file
holds whole records but for the one being written. A record that finds the queue full is dropped. Every record is
counted in ``servex_request_log_records_total{model, outcome}``: ``written``, ``dropped`` (the writer fell behind)
or ``failed`` (it could not be built or written; the error is logged). What is queued is the call's own messages
(or a function the writer calls to build them, for REST calls): nothing may change them once queued.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable

import tensorflow as tf
from prometheus_client import Counter
from tensorflow_serving.apis import logging_pb2, model_pb2, prediction_log_pb2
from tensorflow_serving.config import logging_config_pb2

from servex.loader.config import LoggingSpec, ModelSpec

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 128 << 20  # a file is closed, and the next one started, once it holds this many bytes or more
QUEUE_RECORDS = 512  # records waiting for a logger's writer; more are dropped
SAVED_MODEL_TAGS = ("serve",)  # the tags servex loads SavedModels with (loader/saved_model.py)
CLOSE_SECONDS = 10.0  # at exit, how long the writers have to write what is queued

RECORDS = Counter(
    "servex_request_log_records",
    "PredictionLog records of sampled calls (a model's logging_config): written to its TFRecord files, dropped "
    "(the writer fell behind: its queue was full) or failed (could not be built or written)",
    ["model", "outcome"],
)
OUTCOMES = ("written", "dropped", "failed")

# The record kinds: PredictionLog's fields, with their field numbers
KINDS = {
    kind: prediction_log_pb2.PredictionLog.DESCRIPTOR.fields_by_name[kind].number
    for kind in ("predict_log", "classify_log", "regress_log", "multi_inference_log", "session_run_log")
}
_METADATA_FIELD = prediction_log_pb2.PredictionLog.DESCRIPTOR.fields_by_name["log_metadata"].number
_RECORD_OVERHEAD = 16  # a TFRecord's framing: its length (8 bytes) and two CRCs (4 each)

# (request, response), or a function the writer thread calls to build them
Payload = tuple | Callable[[], tuple]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (a message or bytes) in wire format."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode(kind: str, metadata: logging_pb2.LogMetadata, request, response) -> bytes:
    """The serialized ``PredictionLog{log_metadata, <kind>{request, response}}``, made of the messages' own
    serializations (no copy of the messages into a PredictionLog first)."""
    body = _field(1, request.SerializeToString()) + _field(2, response.SerializeToString())
    return _field(_METADATA_FIELD, metadata.SerializeToString()) + _field(KINDS[kind], body)


def model_spec_of(kind: str, response) -> model_pb2.ModelSpec:
    """The ``model_spec`` of a record's LogMetadata: the answer's (MultiInference: its first result's model and
    version; each task's signature is in its own result)."""
    if kind != "multi_inference_log":
        return response.model_spec
    spec = model_pb2.ModelSpec()
    if response.results:
        first = response.results[0].model_spec
        spec.name = first.name
        if first.HasField("version"):
            spec.version.CopyFrom(first.version)
    return spec


# -- files ----------------------------------------------------------------------------------------------------

_NAMES_LOCK = threading.Lock()
_NEXT_NUMBER: dict[str, int] = {}  # prefix -> the next n of this process's files


def next_path(prefix: str) -> str:
    """The next file of ``prefix`` in this process: ``<prefix>-<pid>-<n>.tfrecord``, skipping names that exist."""
    with _NAMES_LOCK:
        while True:
            number = _NEXT_NUMBER.get(prefix, 0)
            _NEXT_NUMBER[prefix] = number + 1
            path = f"{prefix}-{os.getpid()}-{number:05d}.tfrecord"
            if not os.path.exists(path):
                return path


class TFRecordFiles:
    """TFRecord files named from a prefix, the next one started once one holds ``max_bytes`` or more. Used by one
    thread (a logger's writer)."""

    def __init__(self, prefix: str, max_bytes: int = MAX_FILE_BYTES):
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.path: str | None = None
        self._writer: tf.io.TFRecordWriter | None = None
        self._bytes = 0

    def write(self, record: bytes) -> None:
        """Write one record; close the file once it is full (the next record starts the next file)."""
        if self._writer is None:
            self.path = next_path(self.prefix)
            self._writer = tf.io.TFRecordWriter(self.path)
            self._bytes = 0
        self._writer.write(record)
        self._bytes += len(record) + _RECORD_OVERHEAD
        if self._bytes >= self.max_bytes:
            self.close()

    def flush(self) -> None:
        """Make what was written readable."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


# -- loggers --------------------------------------------------------------------------------------------------


class RequestLogger:
    """The logger of one logging config: sampling on the caller's thread, a bounded queue, and a writer thread that
    builds, serializes and writes the records."""

    def __init__(
        self,
        spec: LoggingSpec,
        *,
        max_file_bytes: int = MAX_FILE_BYTES,
        capacity: int = QUEUE_RECORDS,
        rng: random.Random | None = None,
    ):
        self.spec = spec
        self.rate = spec.sampling_rate
        self.capacity = capacity
        self._random = (rng or random.Random()).random
        self._metadata = logging_pb2.LogMetadata(
            sampling_config=logging_config_pb2.SamplingConfig.FromString(spec.sampling_config),
            saved_model_tags=SAVED_MODEL_TAGS,
        )
        self._files = TFRecordFiles(spec.filename_prefix, max_file_bytes)
        self._pending: collections.deque = collections.deque()
        self._unfinished = 0  # queued and not yet written out (or failed)
        self._changed = threading.Condition()
        self._closed = False
        self._failing = False  # the last write failed (logged once until one succeeds)
        # Held by the writer while it takes a batch and writes it: whoever holds it holds the writer
        self.writing = threading.Lock()
        self._counters: dict[tuple[str, str], object] = {}
        self._thread = threading.Thread(target=self._run, name="servex-request-log", daemon=True)
        self._thread.start()

    # -- the caller's side: never waits on the writer

    def sample(self) -> bool:
        """Whether to log this call (probability ``sampling_rate``)."""
        return self._random() < self.rate

    def log(self, model: str, kind: str, request, response) -> bool:
        """Sample this call of ``model``; if it is sampled, queue its record (``kind``: a PredictionLog field,
        ``predict_log``, ...). ``request`` and ``response`` are the call's messages, which must not change after.
        Returns whether a record was queued."""
        return self._random() < self.rate and self.submit(model, kind, (request, response))

    def submit(self, model: str, kind: str, payload: Payload) -> bool:
        """Queue the record of a call already sampled: ``payload`` is (request, response) or a function that
        builds them (called on the writer thread). Dropped, and counted, when the queue is full."""
        item = (model, kind, payload, int(time.time()))
        with self._changed:
            if not self._closed and len(self._pending) < self.capacity:
                self._pending.append(item)
                self._unfinished += 1
                self._changed.notify_all()
                return True
        self._count(model, "dropped")
        return False

    # -- the writer's side

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._pending and not self._closed:
                    self._changed.wait()
                if not self._pending:  # closed, and all written
                    break
            with self.writing:
                with self._changed:
                    batch = list(self._pending)
                    self._pending.clear()
                self._write(batch)
            with self._changed:
                self._unfinished -= len(batch)
                self._changed.notify_all()
        self._guard(self._files.close, "closing")

    def _write(self, batch: list) -> None:
        written: collections.Counter = collections.Counter()
        for model, kind, payload, timestamp in batch:
            try:
                request, response = payload() if callable(payload) else payload
                metadata = logging_pb2.LogMetadata()
                metadata.CopyFrom(self._metadata)
                metadata.model_spec.CopyFrom(model_spec_of(kind, response))
                metadata.timestamp_secs = timestamp
                record = encode(kind, metadata, request, response)
            except Exception:
                log.exception(
                    "request log %r: cannot build the %s record of a call of model %r", self._files.prefix, kind, model
                )
                self._count(model, "failed")
                continue
            if self._guard(self._files.write, "writing", record):
                written[model] += 1
            else:
                self._count(model, "failed")
        flushed = self._guard(self._files.flush, "flushing")
        for model, count in written.items():
            self._count(model, "written" if flushed else "failed", count)

    def _guard(self, step, what: str, *args) -> bool:
        """Run a file step; on an error, log it (once until a step succeeds), close the file (the next record
        starts another) and return False."""
        try:
            step(*args)
        except (OSError, tf.errors.OpError) as e:
            if not self._failing:
                log.error("request log %r: %s %s failed: %s", self.spec.filename_prefix, what, self._files.path, e)
            self._failing = True
            try:
                self._files.close()
            except (OSError, tf.errors.OpError):
                pass
            return False
        self._failing = False
        return True

    def _count(self, model: str, outcome: str, amount: int = 1) -> None:
        child = self._counters.get((model, outcome))
        if child is None:
            child = self._counters[(model, outcome)] = RECORDS.labels(model, outcome)
        child.inc(amount)

    # -- lifetime

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every record queued so far is written out (or failed); False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: self._unfinished == 0, timeout)

    def close(self, timeout: float | None = 0.0) -> None:
        """Take no more records; the writer writes what is queued, closes its file and ends. Waits up to
        ``timeout`` seconds for that (0: not at all; None: as long as it takes)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if timeout != 0:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for the writer to end (after ``close``); whether it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def closed(self) -> bool:
        return self._closed


class RequestLogs:
    """The loggers of the models served, by model name (``by_model``, replaced whole by ``update``, so that a
    request reads one config's loggers)."""

    def __init__(self, make: Callable[[LoggingSpec], RequestLogger] = RequestLogger):
        self._make = make
        self._lock = threading.Lock()
        self.by_model: dict[str, RequestLogger] = {}

    def get(self, model: str) -> RequestLogger | None:
        return self.by_model.get(model)

    def update(self, specs: Iterable[ModelSpec]) -> None:
        """Log the calls of ``specs``' models as their ``logging`` says (the config in effect from now on)."""
        with self._lock:
            current = {logger.spec: logger for logger in self.by_model.values()}
            kept: dict[LoggingSpec, RequestLogger] = {}
            by_model = {}
            for spec in specs:
                if spec.logging is None:
                    continue
                logger = kept.get(spec.logging) or current.get(spec.logging) or self._make(spec.logging)
                kept[spec.logging] = by_model[spec.name] = logger
            self.by_model = by_model
            for logging_spec, logger in current.items():
                if logging_spec not in kept:
                    logger.close()

    def close(self, timeout: float | None = CLOSE_SECONDS) -> None:
        """Stop logging; wait up to ``timeout`` seconds in all for the writers to write what is queued."""
        with self._lock:
            loggers = set(self.by_model.values())
            self.by_model = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        for logger in loggers:
            logger.close(0.0)
        for logger in loggers:
            logger.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


# The process's loggers: server/lifecycle.py updates them with each config applied, the TensorFlow Serving
# adapters (server/protocols/tfserving/request_logging.py) log through them; at exit what is queued is written.
LOGS = RequestLogs()
atexit.register(LOGS.close)
