"""protos.inference: the KServe v2 / Triton protocol as servex serves it (grpc_service.proto) and Triton's model
configuration (model_config.proto), with Triton's message names and field numbers.

Their full names (``inference.*``) are tritonclient's too, and one process cannot load both sets: servex's server
imports them only where it needs them, and the test suite (which imports tritonclient) reaches them through
``model_config_module``.
"""

from __future__ import annotations

import sys


def model_config_module():
    """The generated ``model_config`` module: servex's, or tritonclient's where that one is loaded already (the
    test suite): one process cannot hold both, and tests/protos checks they are the same field for field."""
    loaded = sys.modules.get("tritonclient.grpc.model_config_pb2")
    if loaded is not None:
        return loaded
    from servex.protos.inference import model_config_pb2

    return model_config_pb2
