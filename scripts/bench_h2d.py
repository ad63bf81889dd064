"""Host-to-device bandwidth of servex's CuPy transfer executor, on a machine with a CUDA GPU and CuPy.

    python scripts/bench_h2d.py [--device 0] [--repeats 20] [--chunk_mib 4] [--buffers 16] [--copy_threads 4]

Prints markdown tables of GB/s (1 GB = 1e9 bytes), each the best of ``--repeats`` timed rounds after a warm-up:
- per input size from 4 KB to 64 MB, from pageable NumPy memory: servex's pinned-pool path
  (``CupyTransferExecutorFactory.to_device``, waiting for the copies to end) against plain ``cupy.asarray``, a
  plain ``cudaMemcpy`` from the same pageable memory (the driver's own staging), and a ``cudaMemcpy`` from memory
  that is already page-locked, the reference no staging path can beat; the goal is the pool path at 64 MB >= 80%
  of the reference;
- many small inputs in one run (256 x 4 KB, 64 x 64 KB): packed into one staging buffer and one copy against
  one ``cupy.asarray`` each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from servex.transfer.base import DeviceError  # noqa: E402
from servex.transfer.cupy_gpu import CHUNK_BYTES, COPY_THREADS, MAX_BUFFERS, CupyTransferExecutorFactory, import_cupy  # noqa: E402

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
MANY = [(256, 4 << 10), (64, 64 << 10)]


def best_seconds(fn, repeats: int, cp) -> float:
    """Best wall time of ``fn()`` followed by a device-wide synchronize, after one warm-up call."""
    fn()
    cp.cuda.Device().synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--chunk_mib", type=int, default=CHUNK_BYTES >> 20, help="staging buffer size (MiB)")
    parser.add_argument("--buffers", type=int, default=MAX_BUFFERS, help="staging buffers in the pool")
    parser.add_argument("--copy_threads", type=int, default=COPY_THREADS, help="host threads filling them")
    args = parser.parse_args()
    try:
        cp = import_cupy(args.device)
    except DeviceError as e:
        print(e, file=sys.stderr)
        return 1
    with cp.cuda.Device(args.device):
        factory = CupyTransferExecutorFactory(
            args.device,
            chunk_bytes=args.chunk_mib << 20,
            max_buffers=args.buffers,
            copy_threads=args.copy_threads,
            handoff="cupy",
        )
        name = cp.cuda.runtime.getDeviceProperties(args.device)["name"].decode()
        print(
            f"GPU {args.device}: {name}; staging pool {args.buffers} x {args.chunk_mib} MiB, "
            f"{args.copy_threads} copy threads\n"
        )
        print(
            "| size | servex pinned pool GB/s | cupy.asarray GB/s | pageable cudaMemcpy GB/s "
            "| pinned cudaMemcpy GB/s | pool / pinned |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        ratio_at_64mb = 0.0
        for size in SIZES:
            host = np.random.default_rng(0).integers(0, 255, size, np.uint8)  # pageable, as requests arrive
            pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(size), np.uint8, size)
            pinned[...] = host
            device = cp.empty(size, cp.uint8)
            pool = best_seconds(lambda h=host: factory.to_device([h]), args.repeats, cp)
            plain = best_seconds(lambda h=host: cp.asarray(h), args.repeats, cp)
            pageable = best_seconds(
                lambda d=device, h=host, n=size: cp.cuda.runtime.memcpy(
                    d.data.ptr, h.ctypes.data, n, cp.cuda.runtime.memcpyHostToDevice
                ),
                args.repeats,
                cp,
            )
            reference = best_seconds(
                lambda d=device, p=pinned, n=size: cp.cuda.runtime.memcpy(
                    d.data.ptr, p.ctypes.data, n, cp.cuda.runtime.memcpyHostToDevice
                ),
                args.repeats,
                cp,
            )
            check = factory.to_device([host])[0]
            assert bool((check == cp.asarray(host)).all()), f"pool path corrupted a {size}-byte input"
            ratio = reference / pool
            if size == SIZES[-1]:
                ratio_at_64mb = ratio
            print(f"| {size >> 10} KB | {gbps(size, pool)} | {gbps(size, plain)} | {gbps(size, pageable)} | "
                  f"{gbps(size, reference)} | {ratio:.0%} |")  # fmt: skip
        print("\n| inputs in one run | packed (one staging buffer) GB/s | one cupy.asarray each GB/s |")
        print("| --- | --- | --- |")
        for count, size in MANY:
            arrays = [np.full(size, i, np.uint8) for i in range(count)]
            packed = best_seconds(lambda a=arrays: factory.to_device(a), args.repeats, cp)
            each = best_seconds(lambda a=arrays: [cp.asarray(x) for x in a], args.repeats, cp)
            print(f"| {count} x {size >> 10} KB | {gbps(count * size, packed)} | {gbps(count * size, each)} |")
        factory.close()
    goal = "met" if ratio_at_64mb >= 0.8 else "NOT met"
    print(f"\nAt 64 MB the pinned-pool path reaches {ratio_at_64mb:.0%} of pinned cudaMemcpy (goal 80%: {goal})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
