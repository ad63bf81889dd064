"""The soak's call mix (scripts/soak.py, scripts/chaos_soak.py): ``Traffic`` sends, over every API servex serves,
answered calls and the failures a client can cause, and names each outcome: ``ok`` when the answer is the one the
call must get, else ``unexpected`` followed by what came (a gRPC code's name, ``HTTP 404``, ``REST connection
error``, ...). ``Tls`` makes a run's certificates (--tls)."""

from __future__ import annotations

import http.client
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT = REPO.parent / "shared" / "bench"
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import tritonclient.grpc as triton  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2  # noqa: E402
from tensorflow_serving.apis import (  # noqa: E402
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

from tests.support.daemon import Daemon  # noqa: E402

OK, INVALID, NOT_FOUND = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


def tensor(values: np.ndarray, dtype=types_pb2.DT_FLOAT) -> tensor_pb2.TensorProto:
    shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in values.shape])
    return tensor_pb2.TensorProto(dtype=dtype, tensor_shape=shape, tensor_content=values.tobytes())


def predict(model: str, name: str, value: np.ndarray, dtype=types_pb2.DT_FLOAT) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.inputs[name].CopyFrom(tensor(value, dtype))
    return request


def infer(model: str, name: str, value: np.ndarray, datatype: str = "FP32", raw: bytes | None = None):
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype=datatype, shape=list(value.shape))
    request.raw_input_contents.append(value.tobytes() if raw is None else raw)
    return request


class Tls:
    """The run's certificates (tests/certificates.py): a CA, servex's SSLConfig file, and each caller's channel
    credentials; ``mutual``: client_verify, and a client certificate for every caller."""

    def __init__(self, work: Path, mutual: bool):
        from tests.certificates import Authority, ssl_config

        self.authority, self.mutual = Authority(), mutual
        self.client = self.authority.client()
        self.config = work / "ssl.config"
        self.config.write_text(ssl_config(self.authority.server(), self.authority.cert, client_verify=mutual))
        self.files = {}
        for name, text in (("ca", self.authority.cert), ("key", self.client.key), ("cert", self.client.cert)):
            self.files[name] = work / f"soak-{name}.pem"
            self.files[name].write_text(text)
        self.stranger = Authority()

    def credentials(self):
        pair = (self.client.key.encode(), self.client.cert.encode()) if self.mutual else (None, None)
        return grpc.ssl_channel_credentials(self.authority.cert.encode(), *pair)

    def triton(self, address: str):
        files = {"private_key": str(self.files["key"]), "certificate_chain": str(self.files["cert"])}
        return triton.InferenceServerClient(address, ssl=True, root_certificates=str(self.files["ca"]),
                                            **(files if self.mutual else {}))  # fmt: skip


class Traffic:
    """One caller's calls; each returns the outcome's name (a gRPC code or an HTTP status), checked against what
    the call must get."""

    def __init__(self, daemon: Daemon, seed: int, tls: Tls | None = None):
        self.rng = random.Random(seed)
        self.tls, self.address = tls, daemon.address
        if tls is None:
            self.channel = grpc.insecure_channel(daemon.address)
        else:
            self.channel = grpc.secure_channel(daemon.address, tls.credentials())
        self.tfs = prediction_service_pb2_grpc.PredictionServiceStub(self.channel)
        self.models = model_service_pb2_grpc.ModelServiceStub(self.channel)
        self.v2 = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.triton = triton.InferenceServerClient(daemon.address) if tls is None else tls.triton(daemon.address)
        self.raw = self.channel.unary_unary("/tensorflow.serving.PredictionService/Predict")  # bytes in, bytes out
        self.rest_port = daemon.rest_port
        self.http = http.client.HTTPConnection("127.0.0.1", daemon.rest_port, timeout=30)
        self.row = np.random.default_rng(seed).random((1, 64), dtype=np.float32)
        self.rows = np.random.default_rng(seed).random((64, 64), dtype=np.float32)

    # -- gRPC -----------------------------------------------------------------------------------------------

    def grpc_call(self, fn, request, *expect: grpc.StatusCode, timeout: float = 30, **kw) -> str:
        try:
            fn(request, timeout=timeout, **kw)
            code = OK
        except grpc.RpcError as e:
            code = e.code()
        return "ok" if code in expect else f"unexpected {code.name} (expected {' or '.join(c.name for c in expect)})"

    def predict_ok(self):
        return self.grpc_call(self.tfs.Predict, predict("mlp", "features", self.row), OK)

    def predict_batch(self):
        return self.grpc_call(self.tfs.Predict, predict("mlp", "features", self.rows), OK)

    def predict_hp2(self):
        return self.grpc_call(self.tfs.Predict, predict("hp2", "x", np.array([[1.0]], np.float32)), OK)

    def predict_unknown_model(self):
        return self.grpc_call(self.tfs.Predict, predict(f"nope{self.rng.randrange(10**6)}", "x", self.row), NOT_FOUND)

    def predict_wrong_name(self):
        return self.grpc_call(self.tfs.Predict, predict("mlp", f"feat{self.rng.randrange(10**6)}", self.row), INVALID)

    def predict_wrong_dtype(self):
        bad = predict("mlp", "features", self.row.astype(np.float64), types_pb2.DT_DOUBLE)
        return self.grpc_call(self.tfs.Predict, bad, INVALID)

    def predict_wrong_shape(self):
        return self.grpc_call(self.tfs.Predict, predict("mlp", "features", np.ones((1, 63), np.float32)), INVALID)

    def predict_short_content(self):
        bad = predict("mlp", "features", self.row)
        bad.inputs["features"].tensor_content = bad.inputs["features"].tensor_content[:-4]
        return self.grpc_call(self.tfs.Predict, bad, INVALID)

    def predict_garbage_bytes(self):
        garbage = bytes(self.rng.randrange(256) for _ in range(64))
        return self.grpc_call(self.raw, b"\x0a\xff\xff\xff\x0f" + garbage, INVALID)

    def predict_deadline(self):
        # 0.2-3 ms: met or not; when not, gRPC or servex (while it waits in the queue) answers DEADLINE_EXCEEDED
        request = predict("mlp", "features", self.rows)
        timeout = 0.0002 + self.rng.random() * 0.003
        return self.grpc_call(self.tfs.Predict, request, OK, grpc.StatusCode.DEADLINE_EXCEEDED, timeout=timeout)

    def predict_cancelled(self):
        future = self.tfs.Predict.future(predict("mlp", "features", self.rows), timeout=30)
        time.sleep(self.rng.random() * 0.001)
        future.cancel()
        try:
            future.result()
        except grpc.FutureCancelledError:
            return "ok"
        except grpc.RpcError as e:
            return "ok" if e.code() == grpc.StatusCode.CANCELLED else f"unexpected {e.code().name}"
        return "ok"  # answered before the cancel reached it

    def metadata(self):
        request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        request.model_spec.name = "mlp"
        return self.grpc_call(self.tfs.GetModelMetadata, request, OK)

    def status_unknown(self):
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = "missing"
        return self.grpc_call(self.models.GetModelStatus, request, NOT_FOUND)

    def v2_ok(self):
        return self.grpc_call(self.v2.ModelInfer, infer("mlp", "features", self.row), OK)

    def v2_wrong_datatype(self):
        return self.grpc_call(
            self.v2.ModelInfer, infer("mlp", "features", self.row, "FP64", self.row.tobytes() * 2), INVALID
        )

    def v2_wrong_size(self):
        return self.grpc_call(self.v2.ModelInfer, infer("mlp", "features", self.row, raw=b"\0" * 12), INVALID)

    def v2_stream(self):
        good = infer("mlp", "features", self.row)
        bad = infer("mlp", "nothing", self.row)
        requests = [good, bad, good] * self.rng.randrange(1, 4)
        answers = self.v2.ModelStreamInfer(iter(requests), timeout=30)
        cut = self.rng.random() < 0.3
        try:
            for i, answer in enumerate(answers):
                if bool(answer.error_message) != (i % 3 == 1):  # every second request of three names no input
                    return f"unexpected stream answer {i}: {answer.error_message!r}"
                if cut and i == 0:
                    answers.cancel()  # the client walks away mid-stream
                    return "ok"
        except grpc.RpcError as e:
            if not (cut and e.code() == grpc.StatusCode.CANCELLED):
                return f"unexpected stream {e.code().name}"
        return "ok"

    def v2_shared_memory(self):
        """Register a system shared-memory region, infer from it into another, unregister both."""
        tag = f"soak-{id(self)}-{self.rng.randrange(10**9)}"
        region_in = shm.create_shared_memory_region(f"{tag}-in", f"/{tag}-in", self.row.nbytes)
        region_out = shm.create_shared_memory_region(f"{tag}-out", f"/{tag}-out", 64)
        try:
            shm.set_shared_memory_region(region_in, [self.row])
            self.triton.register_system_shared_memory(f"{tag}-in", f"/{tag}-in", self.row.nbytes)
            self.triton.register_system_shared_memory(f"{tag}-out", f"/{tag}-out", 64)
            features = triton.InferInput("features", [1, 64], "FP32")
            features.set_shared_memory(f"{tag}-in", self.row.nbytes)
            score = triton.InferRequestedOutput("score")
            score.set_shared_memory(f"{tag}-out", 4)
            self.triton.infer("mlp", [features], outputs=[score], client_timeout=30)
            self.triton.unregister_system_shared_memory(f"{tag}-in")
            self.triton.unregister_system_shared_memory(f"{tag}-out")
        finally:
            shm.destroy_shared_memory_region(region_in)
            shm.destroy_shared_memory_region(region_out)
        return "ok"

    # -- REST ------------------------------------------------------------------------------------------------

    def rest(self, path: str, body: bytes, expect: int, headers: dict | None = None) -> str:
        try:
            self.http.request("POST", path, body=body, headers=headers or {})
            response = self.http.getresponse()
            response.read()
            status = response.status
        except (OSError, http.client.HTTPException):
            self.http.close()  # a fresh connection next time
            self.http = http.client.HTTPConnection("127.0.0.1", self.rest_port, timeout=30)
            return "unexpected REST connection error"
        return "ok" if status == expect else f"unexpected HTTP {status} (expected {expect})"

    def rest_v1_ok(self):
        return self.rest("/v1/models/mlp:predict", json.dumps({"instances": self.row.tolist()}).encode(), 200)

    def rest_v1_bad_json(self):
        return self.rest("/v1/models/mlp:predict", b'{"instances": [[1.0, 2.0,', 400)

    def rest_v1_wrong_shape(self):
        return self.rest("/v1/models/mlp:predict", json.dumps({"instances": [[1.0, 2.0]]}).encode(), 400)

    def rest_v1_unknown(self):
        return self.rest(f"/v1/models/nope{self.rng.randrange(10**6)}:predict", b'{"instances": [1.0]}', 404)

    def rest_v2_ok(self):
        body = {
            "inputs": [{"name": "features", "shape": [1, 64], "datatype": "FP32", "data": self.row.ravel().tolist()}]
        }
        return self.rest("/v2/models/mlp/infer", json.dumps(body).encode(), 200)

    def rest_v2_binary(self):
        head = json.dumps(
            {
                "inputs": [
                    {"name": "features", "shape": [1, 64], "datatype": "FP32", "parameters": {"binary_data_size": 256}}
                ],
                "outputs": [{"name": "score", "parameters": {"binary_data": True}}],
            }
        ).encode()
        return self.rest(
            "/v2/models/mlp/infer", head + self.row.tobytes(), 200, {"Inference-Header-Content-Length": str(len(head))}
        )

    def rest_v2_short_binary(self):
        head = json.dumps(
            {
                "inputs": [
                    {"name": "features", "shape": [1, 64], "datatype": "FP32", "parameters": {"binary_data_size": 256}}
                ]
            }
        ).encode()
        return self.rest(
            "/v2/models/mlp/infer", head + b"\0" * 100, 400, {"Inference-Header-Content-Length": str(len(head))}
        )

    # -- TLS handshakes servex turns away (--tls), each on a connection of its own -------------------------------

    def refused(self, credentials=None) -> str:
        """One Predict on a new connection (plaintext without ``credentials``), which servex must turn away."""
        options = [("grpc.use_local_subchannel_pool", 1)]
        if credentials is None:
            channel = grpc.insecure_channel(self.address, options)
        else:
            channel = grpc.secure_channel(self.address, credentials, options)
        try:
            return self.grpc_call(prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict,
                                  predict("mlp", "x", self.row), grpc.StatusCode.UNAVAILABLE, timeout=10)  # fmt: skip
        finally:
            channel.close()

    def tls_plaintext(self):
        return self.refused()

    def tls_unknown_ca(self):
        return self.refused(grpc.ssl_channel_credentials(self.tls.stranger.cert.encode()))

    def tls_no_client_cert(self):
        return self.refused(grpc.ssl_channel_credentials(self.tls.authority.cert.encode()))

    def calls(self):
        handshakes = []
        if self.tls is not None:
            handshakes = [(self.tls_plaintext, 1), (self.tls_unknown_ca, 1)]
            if self.tls.mutual:
                handshakes.append((self.tls_no_client_cert, 1))
        return handshakes + [
            (self.predict_ok, 8),
            (self.predict_batch, 2),
            (self.predict_hp2, 1),
            (self.predict_unknown_model, 1),
            (self.predict_wrong_name, 1),
            (self.predict_wrong_dtype, 1),
            (self.predict_wrong_shape, 1),
            (self.predict_short_content, 1),
            (self.predict_garbage_bytes, 1),
            (self.predict_deadline, 1),
            (self.predict_cancelled, 1),
            (self.metadata, 1),
            (self.status_unknown, 1),
            (self.v2_ok, 6),
            (self.v2_wrong_datatype, 1),
            (self.v2_wrong_size, 1),
            (self.v2_stream, 1),
            (self.v2_shared_memory, 1),
            (self.rest_v1_ok, 3),
            (self.rest_v1_bad_json, 1),
            (self.rest_v1_wrong_shape, 1),
            (self.rest_v1_unknown, 1),
            (self.rest_v2_ok, 2),
            (self.rest_v2_binary, 2),
            (self.rest_v2_short_binary, 1),
        ]

    def close(self):
        self.http.close()
        self.triton.close()
        self.channel.close()


def call_loop(traffic: Traffic, mix, stop, record) -> None:
    """Send ``mix``'s calls ((method, weight) pairs of ``traffic``) drawn at random until ``stop`` is set, and
    ``record(name, outcome, start, end)`` each (monotonic seconds); the client closes at the end."""
    choices, weights = zip(*mix, strict=True)
    try:
        while not stop.is_set():
            call = traffic.rng.choices(choices, weights)[0]
            start = time.monotonic()
            try:
                outcome = call()
            except Exception as e:  # noqa: BLE001  (a client-side failure is an outcome to report)
                outcome = f"unexpected {type(e).__name__}: {e}"[:300]
            record(call.__name__, outcome, start, time.monotonic())
    finally:
        traffic.close()
