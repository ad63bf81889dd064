"""TensorProtos as the tests build them by hand (the decoders' inputs), and the alias their errors must name."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2

NAME = "images_in"  # input alias passed to to_ndarray; every error message must name it


def dtype_enum(dtype: np.dtype) -> int:
    return tf.as_dtype(dtype).as_datatype_enum


def shaped(dtype_enum: int, shape, **fields) -> tensor_pb2.TensorProto:
    proto = tensor_pb2.TensorProto(dtype=dtype_enum, **fields)
    for d in shape:
        proto.tensor_shape.dim.add(size=d)
    return proto
