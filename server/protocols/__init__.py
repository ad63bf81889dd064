"""servex.server.protocols: one subpackage per protocol, each a thin adapter over the ServingCore.

- ``tfserving/``: TensorFlow Serving's gRPC API (PredictionService, ModelService, SessionService) and REST API
  (``/v1/...``), with Classify, Regress and MultiInference over tf.Examples;
- ``kserve/``: KServe v2 / Open Inference Protocol (what tritonclient speaks), gRPC and REST over one data plane,
  with Triton's extensions (model configuration, statistics, shared memory, repository, log and trace settings);
- ``servex/``: servex's own services (GraphExecutor: runs by tensor names; VariableService on the admin port).

Protocols do not import each other; what two of them share lives in ``transport/`` or the core.
"""
