"""deploy/kserve: servex as a KServe ClusterServingRuntime and example InferenceServices. Each manifest is validated
against KServe's own CRD schemas (../shared/kserve-crds, KServe's config/crd/full: the OpenAPI v3 schema of each
kind, checked with jsonschema, and no field the schema does not define); the runtime's command and args are
servex's own flags; and servex started with that command and those args serves the model KServe mounts at
/mnt/models, over TensorFlow Serving's REST API and KServe v2 REST, with the runtime's probes answering, to KServe's
own Python clients (InferenceRESTClient over v1 and v2, InferenceGRPCClient)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.conftest import REPO
from tests.deploy.conftest import DEPLOY
from tests.support.ports import free_port

KSERVE = DEPLOY / "kserve"
CRDS = REPO.parent / "shared" / "kserve-crds"
MODEL = REPO.parent / "shared" / "models" / "tensorflow_serving_testdata" / "saved_model_half_plus_two_cpu"
CRD_FILES = {"ClusterServingRuntime": "serving.kserve.io_clusterservingruntimes.yaml",
             "InferenceService": "serving.kserve.io_inferenceservices.yaml"}  # fmt: skip
MANIFESTS = sorted(p.name for p in KSERVE.glob("*.yaml"))
START_S = 120


def _schema(kind: str, api_version: str) -> dict:
    crd = yaml.safe_load((CRDS / CRD_FILES[kind]).read_text())
    version = api_version.split("/")[1]
    (found,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return found["schema"]["openAPIV3Schema"]


def _unknown_fields(doc, schema: dict, where: str = "") -> list[str]:
    """Fields of ``doc`` that ``schema`` does not define (a structural schema prunes them: a typo goes unseen)."""
    if isinstance(doc, dict):
        opaque = "properties" not in schema  # metadata: ObjectMeta, which Kubernetes checks itself
        if opaque or schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema:
            return []
        props = schema.get("properties", {})
        out = [f"{where}.{key}" for key in doc if key not in props]
        for key, value in doc.items():
            if key in props:
                out += _unknown_fields(value, props[key], f"{where}.{key}")
        return out
    if isinstance(doc, list):
        items = schema.get("items", {})
        return [field for i, item in enumerate(doc) for field in _unknown_fields(item, items, f"{where}[{i}]")]
    return []


def _load(name: str) -> dict:
    return yaml.safe_load((KSERVE / name).read_text())


@pytest.fixture(scope="module")
def runtime() -> dict:
    return _load("cluster-serving-runtime.yaml")


@pytest.fixture(scope="module")
def container(runtime) -> dict:
    (found,) = runtime["spec"]["containers"]
    return found


def test_there_are_a_runtime_and_inference_services_for_both_protocols():
    docs = [_load(name) for name in MANIFESTS]
    assert [d["kind"] for d in docs].count("ClusterServingRuntime") == 1
    protocols = {d["spec"]["predictor"]["model"]["protocolVersion"] for d in docs if d["kind"] == "InferenceService"}
    assert {"v1", "v2", "grpc-v2"} <= protocols


@pytest.mark.parametrize("name", MANIFESTS)
def test_each_manifest_is_valid_against_kserves_crd(name):
    doc = _load(name)
    schema = _schema(doc["kind"], doc["apiVersion"])
    jsonschema.validate(doc, schema)
    assert not _unknown_fields(doc, schema), f"{name}: fields KServe's CRD does not define"


def test_a_misspelt_field_is_caught():
    doc = _load("cluster-serving-runtime.yaml")
    doc["spec"]["containers"][0]["readinesProbe"] = doc["spec"]["containers"][0].pop("readinessProbe")
    assert _unknown_fields(doc, _schema(doc["kind"], doc["apiVersion"])) == [".spec.containers[0].readinesProbe"]


@pytest.mark.parametrize("name", [n for n in MANIFESTS if n.startswith("inferenceservice")])
def test_inference_services_run_on_the_servex_runtime(name, runtime):
    model = _load(name)["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"] == "servex"
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    formats = {(f["name"], f["version"]) for f in runtime["spec"]["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"]["version"]) in formats


def test_the_runtime_serves_tensorflow_1_and_2_over_every_protocol(runtime):
    spec = runtime["spec"]
    formats = {(f["name"], f["version"]) for f in spec["supportedModelFormats"]}
    assert formats == {("tensorflow", "1"), ("tensorflow", "2")}
    assert set(spec["protocolVersions"]) == {"v1", "grpc-v1", "v2", "grpc-v2"}


def test_the_runtime_container_is_servex_with_its_own_flags(container):
    from servex.server.cli import parse_settings

    assert container["name"] == "kserve-container" and container["command"] == ["servex"]
    args = [a.replace("{{.Name}}", "flowers") for a in container["args"]]
    settings = parse_settings(args).settings
    assert (settings.model_name, settings.model_base_path) == ("flowers", "/mnt/models")
    rest = settings.rest_api_port
    assert [p["containerPort"] for p in container["ports"]] == [rest]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == rest
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    grpc_isvc = _load("inferenceservice-grpc-v2.yaml")["spec"]["predictor"]["model"]
    assert [p["containerPort"] for p in grpc_isvc["ports"]] == [settings.port]


def test_the_runtime_runs_as_non_root_with_resources(container):
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) <= set(container["resources"]["limits"])


def _call(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:  # not listening yet
        return 0, {}


def _mount_models(tmp_path_factory) -> tuple[Path, bool]:
    """The model's version folders where KServe's storage initializer puts them, /mnt/models, where this machine
    lets the test write it (and it is not there already); else a copy elsewhere. Whether the test made it."""
    models = Path("/mnt/models")
    try:
        models.parent.mkdir(exist_ok=True)
        if not models.exists():
            shutil.copytree(MODEL, models)
            return models, True
    except OSError:
        pass
    models = tmp_path_factory.mktemp("mnt") / "models"
    shutil.copytree(MODEL, models)
    return models, False


@pytest.fixture(scope="module")
def pod(container, tmp_path_factory):
    """servex started with the runtime container's command and args as KServe starts it in the pod, {{.Name}}
    filled in, the model at /mnt/models (see _mount_models); the ports moved to free ones (a pod has its own)."""
    models, made = _mount_models(tmp_path_factory)
    ports = dict(zip(("--port", "--rest_api_port", "--metrics_port"), (free_port() for _ in range(3)), strict=True))
    args = []
    for arg in container["args"]:
        flag = arg.split("=", 1)[0]
        args.append(f"{flag}={ports[flag]}" if flag in ports else arg.replace("{{.Name}}", "flowers"))
    if models != Path("/mnt/models"):
        args = [a.replace("/mnt/models", str(models)) for a in args]
    command = [str(Path(sys.executable).parent / container["command"][0]), *args]
    log = tmp_path_factory.mktemp("pod") / "servex.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    rest = f"http://127.0.0.1:{ports['--rest_api_port']}"
    deadline = time.monotonic() + START_S
    try:
        while _call(rest + container["readinessProbe"]["httpGet"]["path"])[0] != 200:
            assert process.poll() is None, f"servex exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready in {START_S} s: {log.read_text()[-3000:]}"
            time.sleep(0.3)
        yield rest, container, f"127.0.0.1:{ports['--port']}"
    finally:
        process.terminate()
        process.wait(30)
        if made:
            shutil.rmtree(models, ignore_errors=True)


def test_the_runtimes_probes_answer_from_servex(pod):
    rest, container, _ = pod
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert _call(rest + container[probe]["httpGet"]["path"])[0] == 200


def test_the_runtime_serves_the_mounted_model_over_v1_and_v2(pod):
    rest, _, _ = pod
    status, answer = _call(f"{rest}/v1/models/flowers:predict", {"instances": [1.0, 2.0]})
    assert (status, answer) == (200, {"predictions": [2.5, 3.0]})
    request = {"inputs": [{"name": "x", "shape": [2, 1], "datatype": "FP32", "data": [1.0, 2.0]}]}
    status, answer = _call(f"{rest}/v2/models/flowers/infer", request)
    assert status == 200, answer
    (output,) = answer["outputs"]
    assert output["data"] == [2.5, 3.0] and output["shape"] == [2, 1]
    status, metadata = _call(f"{rest}/v2/models/flowers")
    assert status == 200 and metadata["versions"] == ["123"]


_KSERVE_CLIENTS = """
import asyncio, json, sys
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.inference_client import InferenceGRPCClient

async def main(rest, address):
    out = {}
    v1 = InferenceRESTClient(RESTConfig(protocol="v1"))
    out["v1"] = (await v1.infer(rest, {"instances": [1.0, 2.0]}, model_name="flowers"))["predictions"]
    v2 = InferenceRESTClient(RESTConfig(protocol="v2"))
    out["v2_ready"] = await v2.is_model_ready(rest, "flowers")
    request = InferRequest(model_name="flowers", infer_inputs=[InferInput("x", [2, 1], "FP32", [1.0, 2.0])])
    out["v2"] = (await v2.infer(rest, request, model_name="flowers")).outputs[0].as_numpy().ravel().tolist()
    grpc_client = InferenceGRPCClient(address)
    out["grpc_ready"] = await grpc_client.is_model_ready("flowers")
    request = InferRequest(model_name="flowers", infer_inputs=[InferInput("x", [2, 1], "FP32", [1.0, 2.0])])
    out["grpc"] = (await grpc_client.infer(request)).outputs[0].as_numpy().ravel().tolist()
    print(json.dumps(out))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.fixture(scope="module")
def kserve_python(tmp_path_factory) -> str:
    """A Python with KServe's package (which needs protobuf < 7) in an environment of its own, layered over the test
    one for everything else."""
    venv = tmp_path_factory.mktemp("kserve") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    layer = f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n"
    (Path(site) / "zz_test_environment.pth").write_text(layer)
    done = subprocess.run([python, "-m", "pip", "install", "-q", "kserve"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return python


def test_kserves_own_clients_are_served_by_the_runtime(pod, kserve_python, tmp_path):
    rest, _, address = pod
    done = subprocess.run([kserve_python, "-c", _KSERVE_CLIENTS, rest, address], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert answers == {"v1": [2.5, 3.0], "v2_ready": True, "v2": [2.5, 3.0], "grpc_ready": True, "grpc": [2.5, 3.0]}
