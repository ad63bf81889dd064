"""server: the servex process.

Owns the CLI and typed settings (server/config/tfserving_flags.py: TensorFlow Serving's flags beyond servex's own;
server/config/triton_flags.py: Triton's command line, for a Triton model repository), the
gRPC port (server/transport/listeners.py: several grpc.aio listeners on it; server/transport/tls.py: TLS from
TensorFlow Serving's
SSLConfig), the services (TensorFlow Serving's
PredictionService and ModelService, KServe v2 / Triton, servex.v1, health, reflection), REST, the Prometheus
/metrics endpoint and shutdown. Protocol adapters (server/protocols/tfserving/grpc_api.py,
server/protocols/kserve/grpc_api.py, server/rest_*.py) are thin: they decode tensors
(server/transport/tensors.py, server/protocols/kserve/v2_types.py; Triton's
shared memory regions in server/protocols/kserve/shared_memory.py; Triton's log and trace settings in
server/protocols/kserve/v2_settings.py) and
call the one ServingCore (server/core.py), which hands runs to `executor/`. server/warmup.py replays a version's
warm-up records through that core before it serves. server/protocols/kserve/v2_config.py answers Triton's ModelConfig
and checks
a Triton repository's config.pbtxt against its SavedModel; server/config/batching.py reads TensorFlow Serving's
BatchingParameters files.
"""
