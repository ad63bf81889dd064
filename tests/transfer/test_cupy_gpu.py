"""The CuPy (GPU) transfer executor: values arrive intact, small inputs packed and large ones chunked through the
bounded page-locked pool, dedicated streams, per-run events, copies that overlap the consumer's kernels without
overwriting memory a kernel still reads, hand-off to CuPy and (where TensorFlow sees the GPU) to TensorFlow by
DLPack, device-to-host copies, metrics. Marked ``gpu``: skipped where no GPU is visible."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest
from prometheus_client import REGISTRY

from servex.transfer import DeviceError, make_factory
from tests.transfer.gpu import requires_gpu

pytestmark = requires_gpu


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


# Waits `ns` nanoseconds of the GPU's clock, then copies n floats: a consumer kernel that is still running (or has
# yet to read its input) while the test does something else.
WAIT_THEN_COPY = r"""
extern "C" __global__ void wait_then_copy(const float* src, float* dst, long long n, long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)ns);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


@pytest.fixture(scope="module")
def wait_then_copy(cp):
    kernel = cp.RawKernel(WAIT_THEN_COPY, "wait_then_copy")

    def launch(src, dst, seconds: float) -> None:
        kernel((32,), (256,), (src, dst, np.int64(src.size), np.int64(int(seconds * 1e9))))

    return launch


@pytest.fixture(scope="module")
def factory(cp):
    from servex.transfer.cupy_gpu import CupyTransferExecutorFactory

    made = CupyTransferExecutorFactory(0, chunk_bytes=1 << 20, max_buffers=3, copy_threads=2, handoff="cupy")
    yield made
    made.close()


def arrays_of_every_kind():
    rng = np.random.default_rng(0)
    return [
        rng.random((3, 4)).astype(np.float32),
        np.array(7, np.int64),  # a scalar
        np.arange(10, dtype=np.int32)[::2],  # strided
        np.array([True, False, True]),
        (rng.random(5) + 1j * rng.random(5)).astype(np.complex64),
        rng.random(1_500_000).astype(np.float64),  # 12 MB: 12 chunks of 1 MiB through 3 buffers
        np.zeros((0, 3), np.float16),
        np.frombuffer(b"\0" * 16 + np.arange(300, dtype=np.uint16).tobytes(), np.uint16, offset=16),
    ]


def test_the_registry_makes_it_with_two_dedicated_streams(cp):
    made = make_factory("gpu:0")
    try:
        assert made.device == "gpu:0"
        assert made.h2d_stream.ptr != 0 and made.d2h_stream.ptr != 0  # not the legacy default stream
        assert made.h2d_stream.ptr != made.d2h_stream.ptr
    finally:
        made.close()


def test_a_gpu_that_does_not_exist_fails_saying_how_many_there_are(cp):
    count = cp.cuda.runtime.getDeviceCount()
    with pytest.raises(DeviceError, match=rf"--device=gpu:{count}: no such GPU; CUDA sees {count} device"):
        make_factory(f"gpu:{count}")


def test_values_arrive_intact_as_cupy_arrays(cp, factory):
    arrays = arrays_of_every_kind()
    results = factory.to_device(arrays)
    for array, result in zip(arrays, results, strict=True):
        assert isinstance(result, cp.ndarray)
        assert result.dtype == array.dtype and result.shape == array.shape
        np.testing.assert_array_equal(cp.asnumpy(result), array)
    assert factory.pool.allocated <= 3


def test_strings_and_bfloat16_stay_on_the_host(factory):
    strings = np.array([b"a", b"bc"], dtype=object)
    half = np.ones(4, ml_dtypes.bfloat16)
    floats = np.ones(4, np.float32)
    out = factory.to_device([strings, half, floats])
    assert out[0] is strings and out[1] is half
    assert not isinstance(out[2], np.ndarray)


def test_small_inputs_share_one_staging_buffer_and_buffers_are_reused(cp):
    from servex.transfer.cupy_gpu import CupyTransferExecutorFactory

    made = CupyTransferExecutorFactory(0, chunk_bytes=1 << 20, max_buffers=4, handoff="cupy")
    try:
        for i in range(30):
            arrays = [np.full(100, i + k, np.int32) for k in range(20)]
            for array, result in zip(arrays, made.to_device(arrays), strict=True):
                np.testing.assert_array_equal(cp.asnumpy(result), array)
        assert made.pool.allocated == 1  # 20 small inputs: one buffer per run, the same one every run
    finally:
        made.close()


def test_each_run_has_its_own_completion_event(factory):
    first, second = factory.create(), factory.create()
    a, b = first.schedule(np.ones(1000, np.float32)), second.schedule(np.zeros(1000, np.float32))
    first.run()
    second.run()
    assert a._run.done is not b._run.done and a._run.block.ptr != b._run.block.ptr


def test_the_consumers_stream_waits_for_the_runs_copies(cp, factory, wait_then_copy):
    blocker = cp.cuda.Stream(non_blocking=True)
    with blocker:
        src = cp.ones(16, cp.float32)
        wait_then_copy(src, cp.empty_like(src), 0.3)
        held = cp.cuda.Event(disable_timing=True)
        held.record(blocker)
    factory.h2d_stream.wait_event(held)  # the next run's copies land only after 0.3 s
    host = np.arange(1 << 16, dtype=np.float32)
    consumer = cp.cuda.Stream(non_blocking=True)
    with consumer:
        executor = factory.create()
        future = executor.schedule(host)
        executor.run()
        view = future.result()  # the host does not wait; the consumer's stream must
        out = cp.zeros_like(view)
        wait_then_copy(view, out, 0.0)  # reads the view at once, on the consumer's stream
    consumer.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), host)


def test_arrays_dropped_with_their_stream_in_a_garbage_cycle(cp, factory):
    import gc

    for i in range(200):
        consumer = cp.cuda.Stream(non_blocking=True)
        with consumer:
            (array,) = factory.to_device([np.full(1000, i, np.float32)])
        cycle = {"stream": consumer, "array": array}
        cycle["self"] = cycle  # the collector finalizes the stream and the array's block in any order
        del consumer, array, cycle
        if i % 10 == 9:
            gc.collect()
    (check,) = factory.to_device([np.ones(10, np.float32)])
    assert float(check.sum()) == 10  # the process is alive and the path still works


def test_copies_overlap_the_consumers_running_kernel(cp, factory, wait_then_copy):
    consumer = cp.cuda.Stream(non_blocking=True)
    host = np.random.default_rng(1).random(2_000_000).astype(np.float32)  # 8 MB: 8 chunks through 3 buffers
    with consumer:
        factory.to_device([host])  # staging buffers and device memory exist before the kernel starts
        consumer.synchronize()
        src = cp.ones(1024, cp.float32)
        wait_then_copy(src, cp.empty_like(src), 0.5)
        kernel_end = cp.cuda.Event(disable_timing=True)
        kernel_end.record(consumer)
        executor = factory.create()
        future = executor.schedule(host)
        executor.run()
        future._run.done.synchronize()
        assert not kernel_end.done  # this run's copies ended while the consumer's kernel still ran
        result = future.result()
    consumer.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(result), host)


def test_a_block_a_kernel_still_reads_is_not_reused_under_it(cp, factory, wait_then_copy):
    consumer = cp.cuda.Stream(non_blocking=True)
    n = 1 << 20
    with consumer:
        (first,) = factory.to_device([np.full(n, 1.0, np.float32)])
        dst = cp.zeros(n, cp.float32)
        wait_then_copy(first, dst, 0.3)
        del first  # the consumer drops its array while its kernel has yet to read it
        later = [factory.to_device([np.full(n, 2.0, np.float32)])[0] for _ in range(3)]
    consumer.synchronize()
    assert float(dst.min()) == 1.0 and float(dst.max()) == 1.0
    assert all(float(a.min()) == 2.0 for a in later)


def test_dropped_blocks_go_back_to_cupys_pool(cp, factory):
    pool = cp.get_default_memory_pool()
    consumer = cp.cuda.Stream(non_blocking=True)
    with consumer:
        for _ in range(3):
            factory.to_device([np.ones(1 << 18, np.float32)])
            consumer.synchronize()
        before = pool.total_bytes()
        for i in range(50):
            (array,) = factory.to_device([np.full(1 << 18, i, np.float32)])  # 1 MiB
            assert float(array[-1]) == i
            del array
    consumer.synchronize()
    assert pool.total_bytes() - before <= 2 << 20  # 50 MiB went through; the retired blocks were reused


def test_concurrent_runs_get_their_own_values(cp, factory):
    errors = []

    def worker(seed: int) -> None:
        try:
            for k in range(10):
                array = np.full(300_000 + k, seed, np.float32)
                (result,) = factory.to_device([array])
                assert float(result[0]) == seed and float(result[-1]) == seed
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and factory.pool.allocated <= 3


def test_to_host_copies_back_on_the_d2h_stream(cp, factory):
    array = np.arange(1000, dtype=np.float32)
    (device,) = factory.to_device([array])
    (back,) = factory.to_host([device * 2])
    assert isinstance(back, np.ndarray)
    np.testing.assert_array_equal(back, array * 2)


def test_session_callers_get_host_arrays_counted_under_the_gpu(factory):
    before = REGISTRY.get_sample_value("servex_h2d_bytes_total", {"device": "gpu:0"}) or 0.0
    array = np.ones(10, np.float32)
    assert factory.transfer([array])[0] is array
    factory.to_device([np.ones(6, np.int8)])
    assert REGISTRY.get_sample_value("servex_h2d_bytes_total", {"device": "gpu:0"}) - before == 46


def test_hand_off_to_tensorflow_by_dlpack(cp):
    tf = pytest.importorskip("tensorflow")

    from servex.transfer.cupy_gpu import CupyTransferExecutorFactory

    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("TensorFlow sees no GPU here")
    made = CupyTransferExecutorFactory(0, handoff="tensorflow")
    try:
        array = np.arange(12, dtype=np.float32).reshape(3, 4)
        (tensor,) = made.to_device([array])
        assert isinstance(tensor, tf.Tensor) and "GPU" in tensor.device
        np.testing.assert_array_equal(tensor.numpy(), array)
    finally:
        made.close()
