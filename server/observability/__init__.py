"""servex.server.observability: what servex shows of itself: request metrics and the Prometheus endpoint
(``metrics.py``, prometheus_client), with TensorFlow Serving's and Triton's metric names beside servex's own, and
request logging (``request_log.py``: the sampled calls of models with a ``logging_config`` written as
TensorFlow Serving's PredictionLog records to TFRecord files, off the request path), and TensorFlow's profiler
service on the gRPC port (``profiler.py``, ``--enable_profiler``: TensorBoard's "Capture profile" records the
process into the client's logdir)."""
