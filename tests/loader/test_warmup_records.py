"""Reading a version's warm-up file (TFRecord of PredictionLog): its absence, its bound, its damage."""

from __future__ import annotations

import pytest
from tensorflow_serving.apis import prediction_log_pb2

from servex.loader import LoadError
from servex.loader.warmup_records import MAX_RECORDS, WARMUP_FILE, read_warmup_records
from tests.support.models import write_warmup_file


def log(signature: str) -> bytes:
    record = prediction_log_pb2.PredictionLog()
    record.predict_log.request.model_spec.signature_name = signature
    return record.SerializeToString()


def test_no_file_no_records(tmp_path):
    assert read_warmup_records(str(tmp_path)) == []


def test_records_come_back_in_order(tmp_path):
    write_warmup_file(tmp_path, [log("a"), log("b")])
    records = read_warmup_records(str(tmp_path))
    assert [r.predict_log.request.model_spec.signature_name for r in records] == ["a", "b"]


def test_at_most_the_maximum(tmp_path):
    write_warmup_file(tmp_path, [log("a")] * MAX_RECORDS)
    assert len(read_warmup_records(str(tmp_path))) == MAX_RECORDS
    (tmp_path / WARMUP_FILE).unlink()
    (tmp_path / WARMUP_FILE).parent.rmdir()
    write_warmup_file(tmp_path, [log("a")] * (MAX_RECORDS + 1))
    with pytest.raises(LoadError, match=f"more than {MAX_RECORDS} records"):
        read_warmup_records(str(tmp_path))


def test_a_truncated_file_is_refused_naming_it(tmp_path):
    write_warmup_file(tmp_path, [log("a"), log("b")])
    data = (tmp_path / WARMUP_FILE).read_bytes()
    (tmp_path / WARMUP_FILE).write_bytes(data[:-3])
    with pytest.raises(LoadError, match="tf_serving_warmup_requests.*not a readable TFRecord file"):
        read_warmup_records(str(tmp_path))
