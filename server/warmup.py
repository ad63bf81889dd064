"""SavedModel warm-up, as TensorFlow Serving does it.

A version folder may hold ``assets.extra/tf_serving_warmup_requests``: a TFRecord file of
``tensorflow.serving.PredictionLog`` records (at most 1,000), each a Predict, Classify, Regress or MultiInference
request. With ``--enable_model_warmup`` (the default) servex replays every record
``--num_request_iterations_for_warmup`` times against the version after it loads and before it becomes
available, through the same code as a client's call (decoding, signature checks, the RunHandler, batching). So
the client graphs those requests use are built and their variables restored (lazy restoration) before any client
reaches the version. The records' model names and versions are ignored: every record runs against the version
being loaded. A record that fails, cannot be read or is of another kind fails the load with its number and the
reason, as in TensorFlow Serving (and the load is retried as any failed load).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

from tensorflow_serving.apis import prediction_log_pb2

from servex.executor import GraphExecutor, RunHandler
from servex.executor.memory import MEMORY
from servex.loader import LoadError, ServedVersion, ServingError
from servex.loader.manager import AVAILABLE
from servex.loader.warmup_records import read_warmup_records
from servex.server.core import REQUEST, RequestInfo, ServingCore
from servex.server.protocols.tfserving import examples
from servex.server.transport import tensors

log = logging.getLogger("servex.warmup")


class _OneVersion:
    """What ServingCore asks of the ModelManager, answered by the version being warmed up, whatever the name."""

    def __init__(self, served: ServedVersion[GraphExecutor]):
        self.served = served

    def get(self, name: str, version: int | None = None, label: str = "") -> ServedVersion[GraphExecutor]:
        return self.served

    acquire = get

    def release(self, served: ServedVersion[GraphExecutor]) -> None:
        pass

    def is_served(self, name: str) -> bool:
        return True


async def _replay(
    record: prediction_log_pb2.PredictionLog, name: str, core: ServingCore, max_tensor_bytes: int | None
) -> None:
    """One record through the code a client's call takes, named for the version being warmed up."""
    kind = record.WhichOneof("log_type")
    if kind == "predict_log":
        request = record.predict_log.request
        inputs = await tensors.decode_all(request.inputs, max_tensor_bytes)
        await core.predict(name, None, "", request.model_spec.signature_name, inputs, request.output_filter)
    elif kind in ("classify_log", "regress_log"):
        request = getattr(record, kind).request
        request.model_spec.name = name
        await (examples.classify if kind == "classify_log" else examples.regress)(core, request)
    elif kind == "multi_inference_log":
        request = record.multi_inference_log.request
        for task in request.tasks:
            task.model_spec.name = name
        await examples.multi_inference(core, request)
    else:
        raise LoadError(
            f"{kind or 'no log_type'} is not supported for warm-up; supported: predict_log, classify_log, "
            f"regress_log, multi_inference_log"
        )


class Warmup:
    """Replays a version's warm-up records on the event loop, from the thread that loads the version."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        run_handler: RunHandler,
        *,
        iterations: int = 1,
        pin_signature_graphs: bool = True,
        max_tensor_bytes: int | None = None,
    ):
        self.loop = loop
        self.run_handler = run_handler
        self.iterations = iterations
        self.pin_signature_graphs = pin_signature_graphs
        self.max_tensor_bytes = max_tensor_bytes

    def __call__(self, name: str, version: int, path: str, executor: GraphExecutor) -> None:
        records = read_warmup_records(path)
        if not records:
            return
        served = ServedVersion(name, version, path, servable=executor, state=AVAILABLE)
        core = ServingCore(_OneVersion(served), self.run_handler, self.pin_signature_graphs, self.max_tensor_bytes)
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:  # no loop in this thread: the usual case, a loading thread
            on_loop = False
        if on_loop:
            raise RuntimeError("warm-up waits for the event loop: run it from a loading thread, not the loop")
        start = time.monotonic()
        done = asyncio.run_coroutine_threadsafe(self._run(name, records, core), self.loop)
        while True:
            try:
                done.result(timeout=1.0)
                break
            except concurrent.futures.TimeoutError:
                if not self.loop.is_running():  # the server stopped: its loop will never finish this
                    done.cancel()
                    raise LoadError(f"the server stopped while model {name!r} version {version} warmed up") from None
        log.info(
            "model %r version %d: warmed up with %d records x %d in %.2fs",
            name, version, len(records), self.iterations, time.monotonic() - start,
        )  # fmt: skip

    async def _run(self, name: str, records: list[prediction_log_pb2.PredictionLog], core: ServingCore) -> None:
        info = RequestInfo()
        REQUEST.set(info)
        for i, record in enumerate(records):
            try:
                for _ in range(self.iterations):
                    try:
                        await _replay(record, name, core, self.max_tensor_bytes)
                    finally:  # what its run was admitted with (executor/memory.py)
                        MEMORY.release(info.memory)
                        info.memory = 0
            except ServingError as e:
                raise LoadError(f"warm-up record {i} ({record.WhichOneof('log_type')}) failed: {e.message}") from e
