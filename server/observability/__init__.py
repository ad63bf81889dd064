"""servex.server.observability: what servex shows of itself: request metrics and the Prometheus endpoint
(``metrics.py``, prometheus_client), with TensorFlow Serving's and Triton's metric names beside servex's own."""
