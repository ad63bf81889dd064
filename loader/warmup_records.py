"""A version's warm-up records: ``assets.extra/tf_serving_warmup_requests``, TensorFlow Serving's TFRecord file
of ``tensorflow.serving.PredictionLog`` records. ``server/warmup.py`` replays them before the version serves."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf
from tensorflow_serving.apis import prediction_log_pb2

from servex.loader.errors import LoadError

WARMUP_FILE = Path("assets.extra", "tf_serving_warmup_requests")
MAX_RECORDS = 1000  # TensorFlow Serving's bound


def read_warmup_records(path: str) -> list[prediction_log_pb2.PredictionLog]:
    """The version's warm-up records; none when it has no warm-up file. LoadError names the file and what is
    wrong: a damaged TFRecord, a record that is not a PredictionLog, more than MAX_RECORDS."""
    file = Path(path) / WARMUP_FILE
    if not file.is_file():
        return []
    records = []
    try:
        for i, data in enumerate(tf.data.TFRecordDataset(str(file)).as_numpy_iterator()):
            if i == MAX_RECORDS:
                raise LoadError(f"warm-up file {str(file)!r} holds more than {MAX_RECORDS} records (the maximum)")
            try:
                records.append(prediction_log_pb2.PredictionLog.FromString(data))
            except Exception as e:  # protobuf's DecodeError
                raise LoadError(f"warm-up file {str(file)!r}: record {i} is not a PredictionLog: {e}") from e
    except tf.errors.OpError as e:
        raise LoadError(f"warm-up file {str(file)!r} is not a readable TFRecord file: {e.message}") from e
    return records
