"""The GPU transfer executor, on CuPy: ``--device=gpu:N``.

Per run, every input with a dtype CuPy has is laid out in one device block (transfer/staging.py): small inputs
are packed into one page-locked staging buffer and go in one copy, large ones in chunks; staging buffers come from
a bounded pool and are reused across runs. Copies are enqueued on a dedicated non-blocking host-to-device stream
and the run records one event when its copies end: each future waits on its own run's event only, never on the
device, and the copies never wait for the consumer's work, so the next run's inputs go in while the consumer
computes on the last ones. The hand-off is DLPack to TensorFlow when TensorFlow sees a GPU
(``tf.experimental.dlpack.from_dlpack``; the host waits on the run's event first, as TensorFlow does not order its
stream after ours), else the CuPy array (the consumer's stream, the one current when the future is read, waits on
the event; the host does not). A second non-blocking stream serves device-to-host copies (``to_host``), so results
can come back while the next run's inputs go in.

A run's device block is allocated on the host-to-device stream and is its own until the consumer has dropped
every array handed to it: then an event is recorded on each stream the arrays were handed to, and the block goes
back to CuPy's pool only once those events are done (what PyTorch's ``record_stream`` does), so a later run's
copies never overwrite memory a kernel still reads. Blocks handed to TensorFlow, whose streams CuPy cannot see,
go back together after one device synchronize once they hold TENSORFLOW_RETIRED_BYTES (or blocks).

Feeding a TensorFlow Session (what GraphExecutor and the variable store do) is the exception, handled by
``transfer``: a Session takes host memory only (``feed_dict`` rejects a ``tf.Tensor`` with TypeError, and a session
callable turns one back into NumPy, a device-to-host copy; measured with TF 2.21), and places the feeds of ops it
runs on the GPU itself, through its own page-locked staging and host-to-device stream. So ``transfer`` hands those
callers host arrays in the layout TensorFlow takes without a copy (as the CPU executor does), counted under this
device; the CuPy copies above serve callers that take device tensors, through ``create()`` and futures.

Strings and dtypes CuPy lacks (bfloat16) stay host arrays. CuPy (and CUDA) are imported only when a GPU factory
is made: servex installs and runs without them, and ``--device=gpu:N`` then fails at start with a DeviceError
that says what is missing. ``servex_h2d_transfer_seconds`` measures the host side of a run's transfers (staging
and enqueueing); the copies themselves complete asynchronously.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from servex.transfer.base import DeviceError, H2DTransferExecutor, H2DTransferExecutorFactory, TransferFuture
from servex.transfer.cpu import to_tensorflow_layout
from servex.transfer.metrics import TransferMetrics
from servex.transfer.staging import StagingBuffer, StagingPool, layout, stage

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20  # one staging buffer
MAX_BUFFERS = 16  # so at most 64 MiB of page-locked memory per device
COPY_THREADS = 8  # host threads helping a large run fill staging buffers (with the run's own)
# NumPy kinds/dtypes CuPy arrays can hold (bool, ints, floats incl. float16, complex).
_CUPY_KINDS = frozenset("biufc")


def import_cupy(index: int):
    """CuPy, once it is known that CUDA device ``index`` is usable; DeviceError saying what is missing."""
    flag = f"--device=gpu:{index}"
    try:
        import cupy
    except ImportError as e:
        raise DeviceError(
            f"{flag} needs CuPy, which is not installed ({e}): install the gpu extra, "
            "pip install 'servex[gpu]' (cupy-cuda12x), or use --device=cpu or --device=auto"
        ) from e
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError: no driver, no device, driver too old
        raise DeviceError(f"{flag}: CuPy is installed but CUDA has no usable device: {e}") from e
    if index >= count:
        raise DeviceError(f"{flag}: no such GPU; CUDA sees {count} device(s): gpu:0 to gpu:{count - 1}")
    return cupy


def tensorflow_sees_a_gpu() -> bool:
    try:
        import tensorflow as tf
    except ImportError:  # the transfer package used on its own, without TensorFlow
        return False
    return bool(tf.config.list_physical_devices("GPU"))


def on_gpu(array: np.ndarray) -> bool:
    return array.dtype.kind in _CUPY_KINDS


# Where a block handed to TensorFlow was used: streams CuPy cannot see, so its retirement waits for the device.
_TENSORFLOW = "tensorflow"
# Blocks retired that way are kept until they add up to this many bytes (or blocks), then freed after one device
# synchronize: not one synchronize per run, which would undo the overlap of copies and compute.
TENSORFLOW_RETIRED_BYTES = 256 << 20
TENSORFLOW_RETIRED_BLOCKS = 64


class RunBlock:
    """One run's device block, alive while any array of that run is: the owner of the CuPy memory the arrays view.

    When the last array is dropped, the block is retired on the factory with the streams it was handed to
    (``used_on``), whose work on it must end before the memory is reused. The streams are held by weak reference:
    an array and its stream dropped together in a garbage cycle are finalized in any order, and CuPy destroys a
    stream's handle in its ``__del__``; a stream already gone makes the retirement wait for the device instead."""

    __slots__ = ("block", "factory", "done", "used_on")

    def __init__(self, block, factory: CupyTransferExecutorFactory, done):
        self.block, self.factory, self.done = block, factory, done
        self.used_on: dict = {}  # stream pointer (or _TENSORFLOW) -> weak reference to the stream (or _TENSORFLOW)

    def use_on(self, stream) -> None:
        self.used_on[getattr(stream, "ptr", stream)] = stream if stream is _TENSORFLOW else weakref.ref(stream)

    def __del__(self):
        self.factory.retire(self.block, list(self.used_on.values()))


class GpuTransferFuture(TransferFuture):
    """A device array of one run: handed off once that run's copies have ended."""

    __slots__ = ("_view", "_run")

    def __init__(self, value=None):
        super().__init__(value)
        self._view = None

    def bind(self, view, run: RunBlock) -> None:
        self._view, self._run = view, run

    def result(self):
        if self._view is not None:
            self._value = self._run.factory.hand_off(self._view, self._run)
            self._view = self._run = None
        return self._value


class CupyTransferExecutor(H2DTransferExecutor):
    def __init__(self, factory: CupyTransferExecutorFactory):
        self.device = factory.device
        self._factory = factory
        self._arrays: list[np.ndarray] = []
        self._futures: list[GpuTransferFuture] = []

    def schedule(self, array: np.ndarray, device: str | None = None) -> TransferFuture:
        self._check_device(device)
        future = GpuTransferFuture(array)  # stays the host array unless it goes to the GPU
        if on_gpu(array):
            self._arrays.append(array)
            self._futures.append(future)
        return future

    def run(self) -> None:
        arrays, futures = self._arrays, self._futures
        self._arrays, self._futures = [], []
        self._factory.copy_to_device(arrays, futures)


class CupyTransferExecutorFactory(H2DTransferExecutorFactory):
    """One GPU's streams, staging pool and copy threads, shared by every run on it."""

    def __init__(
        self,
        index: int = 0,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        max_buffers: int = MAX_BUFFERS,
        copy_threads: int = COPY_THREADS,
        handoff: str | None = None,
    ):
        self._cp = cp = import_cupy(index)
        self.device = f"gpu:{index}"
        self.cuda_device = cp.cuda.Device(index)
        with self.cuda_device:
            self.h2d_stream = cp.cuda.Stream(non_blocking=True)
            self.d2h_stream = cp.cuda.Stream(non_blocking=True)
        self.pool = StagingPool(chunk_bytes, max_buffers, self._pinned)
        self._threads = ThreadPoolExecutor(copy_threads, thread_name_prefix=f"servex-h2d-{index}")
        self._helpers = copy_threads
        if handoff not in (None, "tensorflow", "cupy"):
            raise ValueError(f"handoff must be 'tensorflow' or 'cupy', not {handoff!r}")
        self.handoff = handoff or ("tensorflow" if tensorflow_sees_a_gpu() else "cupy")
        if handoff is None and self.handoff == "cupy":
            log.warning(
                "%s: TensorFlow sees no GPU (is it built with CUDA, are its CUDA libraries installed?): graphs run "
                "on the CPU, and device tensors are handed off as CuPy arrays",
                self.device,
            )
        self.metrics = TransferMetrics(self.device)
        # (device block, events on the streams that used it, or None: wait for the device); appended from
        # RunBlock.__del__ on any thread, so only deque's atomic append/popleft touch it.
        self._retiring: deque = deque()

    def _pinned(self, nbytes: int) -> StagingBuffer:
        cp = self._cp
        with self.cuda_device:
            memory = cp.cuda.PinnedMemoryPointer(cp.cuda.PinnedMemory(nbytes), 0)
        return StagingBuffer(np.frombuffer(memory, np.uint8, nbytes), memory)

    def create(self) -> H2DTransferExecutor:
        return CupyTransferExecutor(self)

    def to_device(self, arrays: Sequence[np.ndarray]) -> list:
        """One run through the CuPy path: every array scheduled, copied, handed off (tf.Tensor or CuPy array)."""
        return H2DTransferExecutorFactory.transfer(self, arrays)

    def transfer(self, arrays: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        """For callers that feed a TensorFlow Session (GraphExecutor, the variable store): host arrays that
        TensorFlow takes without a copy; TensorFlow moves them to the GPU itself (see the module's docstring)."""
        return to_tensorflow_layout(arrays, self.metrics)

    def copy_to_device(self, arrays: Sequence[np.ndarray], futures: Sequence[GpuTransferFuture]) -> None:
        """One run's copies: laid out in one device buffer, staged, enqueued; binds each future to its view."""
        if not arrays:
            return
        start = time.perf_counter()
        cp = self._cp
        flats = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
        offsets, total = layout([f.size for f in flats])
        stream = self.h2d_stream
        with self.cuda_device:
            self._reclaim()
            with stream:  # from the h2d stream's arena of CuPy's pool, ordered after our earlier copies
                block = cp.cuda.alloc(total)
            base = block.ptr

            last = []

            def copy_async(buffer: StagingBuffer, at: int, nbytes: int):  # also on copy threads: set the device
                with self.cuda_device:
                    cp.cuda.runtime.memcpyAsync(
                        base + at, buffer.ptr, nbytes, cp.cuda.runtime.memcpyHostToDevice, stream.ptr
                    )
                    event = cp.cuda.Event(disable_timing=True)
                    event.record(stream)
                last.append(event)
                return event

            if stage(flats, offsets, total, self.pool, copy_async, self._threads, self._helpers) == 1:
                done = last[0]  # one copy: its own event marks the run's end
            else:
                done = cp.cuda.Event(disable_timing=True)
                done.record(stream)
            run = RunBlock(block, self, done)
            owned = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(base, total, run, self.cuda_device.id), 0)
            device = cp.ndarray((total,), cp.uint8, owned)
        for array, offset, future in zip(arrays, offsets, futures, strict=True):
            view = device[offset : offset + array.nbytes].view(array.dtype).reshape(array.shape)
            future.bind(view, run)
        self.metrics.bytes.inc(sum(a.nbytes for a in arrays))
        self.metrics.seconds.observe(time.perf_counter() - start)

    def hand_off(self, view, run: RunBlock):
        """The consumer's tensor for a device view, once the run's copies (``run.done``) have ended."""
        if self.handoff == "tensorflow":
            import tensorflow as tf

            run.done.synchronize()
            run.use_on(_TENSORFLOW)
            return tf.experimental.dlpack.from_dlpack(view.toDlpack())
        with self.cuda_device:
            consumer = self._cp.cuda.get_current_stream()
            consumer.wait_event(run.done)
        run.use_on(consumer)
        return view

    def retire(self, block, used_on: list) -> None:
        """A run's block whose arrays are all dropped: reusable once the streams that used it are past it (an event
        on each), or after a device synchronize where one is unknown or gone."""
        try:
            streams = [ref if ref is _TENSORFLOW else ref() for ref in used_on]
            if any(s is _TENSORFLOW or s is None for s in streams):
                self._retiring.append((block, None))
                return
            events = []
            with self.cuda_device:
                for stream in streams:
                    event = self._cp.cuda.Event(disable_timing=True)
                    event.record(stream)
                    events.append(event)
            self._retiring.append((block, events))
        except Exception:  # never free it under a kernel: the next run's reclaim waits for the device first
            self._retiring.append((block, None))
            log.debug("%s: could not record a retired block's events", self.device, exc_info=True)

    def _reclaim(self) -> None:
        """Give back to CuPy's pool the retired blocks no stream uses any more (dropping the last reference)."""
        retiring = self._retiring
        if not retiring:
            return
        after_device = []  # retired where streams are unknown: kept referenced until the device is past them
        for _ in range(len(retiring)):
            try:
                item = retiring.popleft()
            except IndexError:  # another run's reclaim took it
                break
            events = item[1]
            if events is None:
                after_device.append(item)
            elif not all(e.done for e in events):
                retiring.append(item)
        if not after_device:
            return
        held = sum(block.mem.size for block, _ in after_device)
        if held < TENSORFLOW_RETIRED_BYTES and len(after_device) < TENSORFLOW_RETIRED_BLOCKS:
            retiring.extend(after_device)  # not worth a device synchronize yet
            return
        self.cuda_device.synchronize()

    def to_host(self, arrays: Sequence) -> list[np.ndarray]:
        """Device arrays back to NumPy on the device-to-host stream, after the consumer's work on them."""
        cp = self._cp
        with self.cuda_device:
            ready = cp.cuda.Event(disable_timing=True)
            ready.record(cp.cuda.get_current_stream())
            self.d2h_stream.wait_event(ready)
            return [cp.asarray(a).get(stream=self.d2h_stream) for a in arrays]

    def close(self) -> None:
        self._threads.shutdown(wait=True)
