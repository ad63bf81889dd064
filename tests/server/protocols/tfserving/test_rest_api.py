"""TensorFlow Serving's REST adapter (server/protocols/tfserving/rest_api.py) in process: servex's REST server over a
ServingCore serving half_plus_two, called over HTTP, in milliseconds. The daemon tests (tests/integration/test_rest.py)
cover the same API end to end."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from servex.server.protocols.tfserving import rest_api
from tests.support.in_process import rest_server, serving_core


@pytest.fixture(scope="module")
def url():
    with serving_core("hp") as core, rest_server(core, rest_api.add_routes) as base:
        yield base


def call(url: str, body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_predict_answers_instances_as_tensorflow_serving(url):
    assert call(f"{url}/v1/models/hp:predict", b'{"instances": [1.0, 2.0, 5.0]}') == (
        200, {"predictions": [2.5, 3.0, 4.5]})  # fmt: skip


def test_predict_errors_name_what_was_wrong(url):
    status, answer = call(f"{url}/v1/models/hp:predict", b'{"instances": [1.0,')
    assert status == 400 and "JSON" in answer["error"]
    status, answer = call(f"{url}/v1/models/nope:predict", b'{"instances": [1.0]}')
    assert status == 404 and "nope" in answer["error"]


def test_model_status_reports_the_version_available(url):
    status, answer = call(f"{url}/v1/models/hp")
    assert status == 200
    (version,) = answer["model_version_status"]
    assert (version["version"], version["state"]) == ("123", "AVAILABLE")
