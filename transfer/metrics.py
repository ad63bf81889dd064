"""Transfer metrics, labelled by device (prometheus_client, exported on /metrics).

``servex_h2d_transfer_seconds``: the time one run's host-to-device transfers took (CPU, and GPU runs that feed a
TensorFlow Session: the alignment copies only, so ~0; GPU runs through the CuPy path: staging and enqueueing).
``servex_h2d_bytes_total``: bytes of the host arrays handed to the transfer executor.
Label children are resolved once per factory, never per run.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

H2D_SECONDS = Histogram(
    "servex_h2d_transfer_seconds",
    "Time one run's host-to-device transfers took",
    ["device"],
    buckets=(
        1e-6,
        2.5e-6,
        5e-6,
        1e-5,
        2.5e-5,
        5e-5,
        1e-4,
        2.5e-4,
        5e-4,
        1e-3,
        2.5e-3,
        5e-3,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        1,
    ),
)
H2D_BYTES = Counter("servex_h2d_bytes", "Bytes of host arrays handed to the transfer executor", ["device"])


class TransferMetrics:
    """The label children of one device."""

    __slots__ = ("seconds", "bytes")

    def __init__(self, device: str):
        self.seconds = H2D_SECONDS.labels(device)
        self.bytes = H2D_BYTES.labels(device)
