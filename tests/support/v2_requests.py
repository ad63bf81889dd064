"""KServe v2 gRPC requests as tritonclient builds them (its own generated messages: servex's inference.* modules
and tritonclient's share full names and cannot be loaded into one process)."""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import InferInput, service_pb2

from servex.server.protocols.kserve import v2_types

Request = service_pb2.ModelInferRequest


def raw_request(arrays: dict[str, np.ndarray]) -> Request:
    """A request as tritonclient builds it from NumPy arrays (set_data_from_numpy: the raw path)."""
    request = Request(model_name="m")
    for name, array in arrays.items():
        infer_input = InferInput(name, list(array.shape), v2_types.datatype(array.dtype))
        infer_input.set_data_from_numpy(array)  # BF16 as ml_dtypes.bfloat16, as tritonclient takes it since r26.06
        request.inputs.append(infer_input._get_tensor())
        request.raw_input_contents.append(infer_input._get_content())
    return request


def fp32_request(model="tf1", name="x", values=(1.0,), shape=(1, 1), raw=False, datatype="FP32"):
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
    if raw:
        request.raw_input_contents.append(np.array(values, np.float32).tobytes())
    else:
        tensor.contents.fp32_contents.extend(values)
    return request
