"""server: the servex process.

Owns the CLI and typed settings (server/tfserving_flags.py: TensorFlow Serving's flags beyond servex's own;
server/triton_flags.py: Triton's command line, for a Triton model repository), the
gRPC port (server/listeners.py: several grpc.aio listeners on it; server/tls.py: TLS from TensorFlow Serving's
SSLConfig), the services (TensorFlow Serving's
PredictionService and ModelService, KServe v2 / Triton, servex.v1, health, reflection), REST, the Prometheus
/metrics endpoint and shutdown. Protocol adapters (server/tfserving.py,
server/kserve.py, server/rest_*.py) are thin: they decode tensors (server/tensors.py, server/v2_types.py; Triton's
shared memory regions in server/shared_memory.py; Triton's log and trace settings in server/v2_settings.py) and
call the one ServingCore (server/core.py), which hands runs to `executor/`. server/warmup.py replays a version's
warm-up records through that core before it serves. server/v2_config.py answers Triton's ModelConfig and checks
a Triton repository's config.pbtxt against its SavedModel; server/batching_config.py reads TensorFlow Serving's
BatchingParameters files.
"""
