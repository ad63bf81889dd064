"""server: the servex process.

Owns the CLI and typed settings, the gRPC services (TensorFlow Serving's PredictionService and ModelService,
health, reflection), the Prometheus /metrics endpoint and shutdown. Protocol adapters (server/tfserving.py) are
thin: they decode protobufs with server/tensors.py and call the one ServingCore (server/core.py), which hands
runs to `executor/`.
"""
