"""deploy/prometheus and deploy/grafana against the real thing: promtool checks and unit-tests the rules; a real
Prometheus (Debian's) on loopback scrapes a real servex daemon every second while Predict requests are driven,
and the counts, the rules' expressions and the prometheus-adapter query are read back through its HTTP API; every
metric the dashboard, the rules and deploy/README.md's table name exists in servex's live /metrics output."""

from __future__ import annotations

import datetime
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.certificates import Authority, ssl_config
from tests.deploy.conftest import DASHBOARD, DEPLOY, KUBERNETES, RULES, RULES_TEST
from tests.support.clients import predict_y
from tests.support.daemon import Daemon, free_port, metric, terminate
from tests.support.paths import HALF_PLUS_TWO_TF2

MODEL = "hpt"
METRIC_NAME = re.compile(r"(?<![\w:])(servex_[a-zA-Z0-9_]+)(?![\w:])")


# ---- rules, offline -----------------------------------------------------------------------------------------------


def test_promtool_check_rules(promtool):
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_of_the_alerts(promtool):
    result = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rejects_a_broken_rule(promtool, tmp_path):
    """promtool really parses the expressions (the check above is not a formality)."""
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        RULES.read_text().replace("sum by (model) (servex_queue_depth)", "sum by (model (servex_queue_depth)")
    )
    result = subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True, text=True)
    assert result.returncode != 0


def rule_expressions() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(r.get("record") or r["alert"], r["expr"]) for g in groups for r in g["rules"]]


def dashboard_expressions() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            exprs.append((f"variable {var['name']}", query))
    return exprs


def test_dashboard_shape():
    board = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["multi"] and variables["model"]["includeAll"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {panel['title']!r} overlaps another"
                cells.add((x, y))
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            if "model" in target["expr"] and "servex_h2d" not in target["expr"]:
                assert 'model=~"$model"' in target["expr"], f"{panel['title']}: not filtered by $model"
    text = DASHBOARD.read_text()
    for topic in ("servex_requests_total", "servex_request_latency_seconds_bucket", "servex_queue_wait_seconds",
                  "servex_run_seconds", "servex_batch_size", "servex_client_graph_cache_hits_total",
                  "servex_variable_restore_seconds", "servex_restored_variable_bytes",
                  "servex_h2d_transfer_seconds", "servex_tls_certificate_expiry_timestamp_seconds",
                  "servex_tls_certificate_reloads_total"):  # fmt: skip
        assert topic in text, topic


# ---- a live servex and a real Prometheus --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_base(tmp_path_factory):
    base = tmp_path_factory.mktemp("models") / MODEL
    shutil.copytree(HALF_PLUS_TWO_TF2 / "00000123", base / "1")
    return base


@pytest.fixture(scope="module")
def daemon(start_daemon, tmp_path_factory, model_base):
    """servex serving gRPC over TLS (so that its TLS metrics have series) with its metrics in plaintext."""
    folder = tmp_path_factory.mktemp("servex")
    authority = Authority()
    a_year = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=365)  # far from the expiry alert
    (folder / "ssl.config").write_text(ssl_config(authority.server(not_after=a_year)))
    d = start_daemon(
        f"--model_name={MODEL}",
        f"--model_base_path={model_base}",
        "--file_system_poll_wait_seconds=0.5",
        "--max_num_load_retries=0",
        f"--ssl_config_file={folder / 'ssl.config'}",
        credentials=grpc.ssl_channel_credentials(authority.cert.encode()),
    )
    predict_times(d, 1)  # the first call builds the client graph and restores variables: slow, and before any scrape
    return d


def predict_times(daemon: Daemon, n: int, priority: int = 0) -> None:
    """``n`` Predict calls of half_plus_two at ``priority``, each answered right."""
    for _ in range(n):
        assert predict_y(daemon.channel, MODEL, [1.0, 2.0], priority=priority, timeout=10) == [2.5, 3.0]


class Prometheus:
    """A real Prometheus server on a free loopback port, scraping ``target`` every second, with servex's rules."""

    def __init__(self, binary: str, target: str, workdir):
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES)],
                    "scrape_configs": [{"job_name": "servex", "static_configs": [{"targets": [target]}]}],
                }
            )
        )
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("/api/v1/query", query=expr)["result"]

    def wait(self, what: str, predicate, timeout: float = 60):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                last = predicate()
                if last:
                    return last
            except (OSError, AssertionError) as e:
                last = e
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}; last: {last}\n{self.log_path.read_text()[-3000:]}")

    def stop(self):
        terminate(self.proc)
        self._log.close()


@pytest.fixture(scope="module")
def prometheus(prometheus_tools, daemon, tmp_path_factory):
    prom = Prometheus(prometheus_tools[1], f"127.0.0.1:{daemon.metrics_port}", tmp_path_factory.mktemp("prometheus"))
    try:
        prom.wait("readiness", lambda: urllib.request.urlopen(f"http://127.0.0.1:{prom.port}/-/ready").status == 200)
        prom.wait("servex scraped", lambda: [r for r in prom.query('up{job="servex"} == 1')])
        yield prom
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def traffic(daemon, prometheus, model_base):
    """Requests at two priorities once Prometheus scrapes, then a version that fails to load (so every labelled
    series exists); returns the number of Predicts, the warm-up one included."""
    predict_times(daemon, 15, priority=0)
    predict_times(daemon, 5, priority=3)
    broken = model_base / "2"
    broken.mkdir()
    (broken / "saved_model.pb").write_bytes(b"not a SavedModel")
    deadline = time.monotonic() + 60
    while metric(daemon, "servex_model_load_failures_total", model=MODEL) < 1:
        assert time.monotonic() < deadline, f"the broken version never failed to load:\n{daemon.log()}"
        time.sleep(0.2)
    predict_times(daemon, 1)  # still serving version 1
    return 1 + 15 + 5 + 1


def live_sample_names(daemon) -> set[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_reads_request_counts_scraped_from_servex(daemon, prometheus, traffic):
    expr = f'sum(servex_request_latency_seconds_count{{job="servex",model="{MODEL}",method="Predict"}})'

    def counted():
        result = prometheus.query(expr)
        return result and float(result[0]["value"][1]) == traffic

    prometheus.wait(f"{expr} == {traffic}", counted)
    # and it keeps scraping: more requests show up
    predict_times(daemon, 4)
    prometheus.wait(f"{expr} == {traffic + 4}", lambda: float(prometheus.query(expr)[0]["value"][1]) == traffic + 4)
    by_priority = {r["metric"]["priority"]: float(r["value"][1]) for r in prometheus.query(
        f'sum by (priority) (servex_requests_total{{model="{MODEL}",code="OK",method="Predict"}})')}  # fmt: skip
    assert by_priority == {"0": traffic - 5 + 4, "3": 5}


def test_rule_expressions_evaluate_on_live_data(prometheus, traffic):
    """Each recording rule's and alert's expression runs on what Prometheus scraped from servex; every recording
    rule gives a result for the model (alerts must not fire: the server is healthy)."""
    rate = f'sum by (model) (rate(servex_requests_total{{model="{MODEL}"}}[5m])) > 0'
    prometheus.wait("a request rate over two scrapes", lambda: prometheus.query(rate))
    for name, expr in rule_expressions():
        result = prometheus.query(expr)
        if name.startswith("Servex"):
            assert name == "ServexModelLoadFailures" or result == [], f"{name} fires on a healthy server: {result}"
        elif name.startswith("model"):
            assert any(r["metric"].get("model") == MODEL for r in result), f"{name}: no result for {MODEL}: {expr}"
    load_failures = prometheus.query(dict(rule_expressions())["ServexModelLoadFailures"])
    assert [r["metric"]["model"] for r in load_failures] == [MODEL], "the failed load of version 2 must alert"
    rules = prometheus.api("/api/v1/rules")["groups"]
    assert {g["name"] for g in rules} == {"servex.recording", "servex.alerts"}
    assert all(r["health"] != "err" for g in rules for r in g["rules"]), rules


def test_prometheus_adapter_query_gives_queue_depth_per_pod(prometheus, traffic):
    """The adapter rule's metricsQuery, filled in as prometheus-adapter does, answers one series per target."""
    values = yaml.safe_load((KUBERNETES / "hpa-queue-depth" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
    query = (
        rule["metricsQuery"]
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", 'job="servex"')
        .replace("<<.GroupBy>>", "instance")
    )
    result = prometheus.query(query)
    assert len(result) == 1 and float(result[0]["value"][1]) >= 0, result


def test_every_metric_used_exists_in_servex_metrics(daemon, traffic):
    live = live_sample_names(daemon)
    used = {}
    for source, exprs in (("rules", rule_expressions()), ("dashboard", dashboard_expressions())):
        for where, expr in exprs:
            for name in METRIC_NAME.findall(expr):
                used.setdefault(name, f"{source}: {where}")
    assert used
    missing = {name: where for name, where in used.items() if name not in live}
    assert not missing, f"not in servex's /metrics: {missing}"


def test_readme_metric_table_matches_servex_metrics(daemon, traffic):
    """deploy/README.md documents every metric family servex exports, and only those."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10).read().decode()
    families = {f.name for f in text_string_to_metric_families(text) if f.name.startswith("servex_")}
    documented = set(re.findall(r"^\| `(servex_\w+)` \|", (DEPLOY / "README.md").read_text(), re.M))
    # the table names counters as exposed (with _total); prometheus_client's parser strips it from family names
    documented = {name.removesuffix("_total") for name in documented}
    assert documented == families, {"undocumented": families - documented, "not exported": documented - families}
