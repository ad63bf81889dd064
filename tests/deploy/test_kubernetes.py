"""deploy/kubernetes and deploy/overlays: rendered by the real kustomize (kubectl kustomize), every object
validated offline against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields fail) for the
oldest and newest supported Kubernetes, the Prometheus Operator objects against the operator's CRD models
(cloudcoil-models-prometheus-operator, generated from the CRDs; a field the model drops counts as unknown), and
what the manifests promise about probes, shutdown, security, scaling and wiring."""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as monitoring
from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from tests.deploy.conftest import KUBERNETES, QUEUE_DEPTH_OVERLAY, RULES, TLS_OVERLAY, kustomize

K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())  # 1.27: gRPC probes are GA
CRD_MODELS = {("monitoring.coreos.com/v1", "PodMonitor"): monitoring.PodMonitor,
              ("monitoring.coreos.com/v1", "PrometheusRule"): monitoring.PrometheusRule}  # fmt: skip


def validate_crd(doc: dict) -> None:
    """Validate a Prometheus Operator object against its CRD model; fields the model does not know fail."""
    model = CRD_MODELS[(doc["apiVersion"], doc["kind"])]
    parsed = model.model_validate(doc)
    again = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert again == doc, f"{doc['kind']} {doc['metadata']['name']} has fields its CRD does not define"


def validate(doc: dict) -> None:
    if (doc["apiVersion"], doc["kind"]) in CRD_MODELS:
        validate_crd(doc)
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.fixture(scope="module")
def base(kubectl) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in kustomize(kubectl, KUBERNETES)}


@pytest.fixture(scope="module")
def overlay(kubectl) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in kustomize(kubectl, QUEUE_DEPTH_OVERLAY)}


@pytest.fixture(scope="module")
def container(base) -> dict:
    (c,) = base["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def test_kustomization_renders_every_object(base):
    kinds = set(base)
    assert kinds == {"Deployment", "Service", "ConfigMap", "PersistentVolumeClaim", "HorizontalPodAutoscaler",
                     "PodDisruptionBudget", "PodMonitor", "PrometheusRule"}  # fmt: skip


@pytest.mark.parametrize("folder", [KUBERNETES, QUEUE_DEPTH_OVERLAY, TLS_OVERLAY], ids=["base", "queue-depth", "tls"])
def test_every_rendered_object_validates_offline(kubectl, folder):
    docs = kustomize(kubectl, folder)
    assert docs
    for doc in docs:
        validate(doc)


def test_every_manifest_file_is_used():
    """A manifest lying in deploy/kubernetes but left out of kustomization.yaml would never be applied."""
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == listed


def test_validators_reject_broken_manifests(base):
    """The checks above have teeth: a misspelt field, a wrong type, a bad CRD field all fail."""
    deployment = copy.deepcopy(base["Deployment"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    deployment = copy.deepcopy(base["Deployment"])
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    monitor = copy.deepcopy(base["PodMonitor"])
    monitor["spec"]["podMetricsEndpoint"] = monitor["spec"].pop("podMetricsEndpoints")
    with pytest.raises(AssertionError, match="fields its CRD does not define"):
        validate(monitor)
    monitor = copy.deepcopy(base["PodMonitor"])
    monitor["spec"]["podMetricsEndpoints"] = "metrics"
    with pytest.raises(ValueError):
        validate(monitor)


def test_probes_are_native_grpc_health_checks_on_8500(container):
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": 8500, "service": ""}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "large models need 10 minutes to load"
    live = container["livenessProbe"]
    # liveness must not kill a pod that is draining: it tolerates NOT_SERVING longer than the drain lasts
    assert live["periodSeconds"] * live["failureThreshold"] > drain_seconds(container)


def drain_seconds(container: dict) -> float:
    flags = [a for a in container["args"] if a.startswith("--drain_seconds=")]
    return float(flags[0].split("=", 1)[1]) if flags else 20.0


def test_grace_period_covers_pre_stop_sleep_and_drain(base, container):
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    sleep = float(pre_stop[1])
    grace = base["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    drain = drain_seconds(container)
    assert sleep + drain < grace <= sleep + drain + 15, (sleep, drain, grace)


def test_ports_and_args_agree(base, container):
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 8500, "http": 8501, "metrics": 8502}
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert args["port"] == "8500" and args["rest_api_port"] == "8501" and args["metrics_port"] == "8502"
    service_ports = {p["name"]: (p["port"], p["targetPort"]) for p in base["Service"]["spec"]["ports"]}
    assert service_ports == {"grpc": (8500, "grpc"), "http": (8501, "http"), "metrics": (8502, "metrics")}
    (endpoint,) = base["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"


def test_selectors_match_the_pods(base):
    pod_labels = base["Deployment"]["spec"]["template"]["metadata"]["labels"]
    selectors = [
        base["Deployment"]["spec"]["selector"]["matchLabels"],
        base["Service"]["spec"]["selector"],
        base["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
        base["PodMonitor"]["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert selector and selector.items() <= pod_labels.items(), selector
    target = base["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", base["Deployment"]["metadata"]["name"])


def test_pod_is_locked_down(base, container):
    pod = base["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    resources = container["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys() and {"cpu", "memory"} <= resources["limits"].keys()


def test_volumes_models_config_and_tmp(base, container):
    pod = base["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]], "a read-only root needs a writable /tmp"
    assert mounts["/models"]["readOnly"] is True
    claim = volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim == base["PersistentVolumeClaim"]["metadata"]["name"]
    config_volume = volumes[mounts["/etc/servex"]["name"]]["configMap"]["name"]
    assert config_volume == base["ConfigMap"]["metadata"]["name"], "kustomize must rewrite the hashed name"
    assert "--model_config_file=/etc/servex/models.config" in container["args"]


def test_model_config_parses_and_points_under_models(base):
    text = base["ConfigMap"]["data"]["models.config"]
    config = text_format.Parse(text, model_server_config_pb2.ModelServerConfig())
    assert config.model_config_list.config
    for model in config.model_config_list.config:
        assert model.name and model.base_path.startswith("/models/"), model


def test_cpu_hpa_and_pdb(base):
    hpa = base["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert hpa["spec"]["minReplicas"] >= 2, "one pod cannot roll or drain without an outage"
    pdb = base["PodDisruptionBudget"]["spec"]
    assert pdb.get("maxUnavailable") == 1 or pdb.get("minAvailable", 0) >= 1


def test_queue_depth_variant(overlay, base):
    metrics = overlay["HorizontalPodAutoscaler"]["spec"]["metrics"]
    pods = [m["pods"] for m in metrics if m["type"] == "Pods"]
    assert pods == [{"metric": {"name": "servex_queue_depth"}, "target": {"type": "AverageValue", "averageValue": "4"}}]
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in metrics), "keeps CPU too"
    # everything else is the base, unchanged
    assert {k: v for k, v in overlay.items() if k != "HorizontalPodAutoscaler"} == {
        k: v for k, v in base.items() if k != "HorizontalPodAutoscaler"
    }
    values = yaml.safe_load((KUBERNETES / "hpa-queue-depth" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert rule["name"]["as"] == "servex_queue_depth"
    assert re.match(r"servex_queue_depth\{", rule["seriesQuery"])
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_tls_variant(kubectl, base, container):
    tls = {doc["kind"]: doc for doc in kustomize(kubectl, TLS_OVERLAY)}
    pod = tls["Deployment"]["spec"]["template"]["spec"]
    (served,) = pod["containers"]
    from servex.server.cli import build_parser

    args = build_parser().parse_args(served["args"])  # servex's own flags, the base's kept
    assert served["args"][: len(container["args"])] == container["args"]
    assert (args.ssl_server_cert_file, args.ssl_server_key_file, args.ssl_custom_ca_file, args.ssl_client_verify) == (
        "/etc/servex-tls/tls.crt",
        "/etc/servex-tls/tls.key",
        "/etc/servex-tls/ca.crt",
        True,
    )
    assert {"name": "tls", "mountPath": "/etc/servex-tls", "readOnly": True} in served["volumeMounts"]
    assert {"name": "tls", "secret": {"secretName": "servex-tls", "defaultMode": 0o440}} in pod["volumes"]
    # the probes ask REST's readiness (native gRPC probes speak no TLS) with the base's timings
    ports = {p["name"]: p["containerPort"] for p in served["ports"]}
    assert ports["http"] == 8501 and "--rest_api_port=8501" in served["args"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        expected = {k: v for k, v in container[probe].items() if k != "grpc"}
        assert served[probe] == {**expected, "httpGet": {"path": "/v2/health/ready", "port": "http"}}, probe
    # everything else is the base, unchanged
    assert {k: v for k, v in tls.items() if k != "Deployment"} == {k: v for k, v in base.items() if k != "Deployment"}


def test_prometheus_rule_matches_the_rule_file(base):
    """The Operator's PrometheusRule carries the same groups as deploy/prometheus/servex-rules.yaml."""
    assert base["PrometheusRule"]["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_container_args_are_servex_flags(container):
    """Every flag the Deployment passes exists in servex's CLI (a renamed flag would crash-loop the pods)."""
    from servex.server.cli import build_parser

    args = build_parser().parse_args(container["args"])
    assert args.model_config_file == "/etc/servex/models.config"
    assert args.drain_seconds == drain_seconds(container)
