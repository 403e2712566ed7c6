"""The `monitoring` compose profile, checked where no Docker engine runs: Prometheus scrapes services and
ports that exist, Grafana's provisioning fits its mounts, every vLLM metric the dashboard queries is one
the installed vLLM 0.32 registers, and `make monitoring` gives Grafana a password.

The gateway's own metric names are checked against a live gateway in tests/proxy/test_proxy_metrics.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from test_bundle import REPO, compose

MONITORING = REPO / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "bonsai.json"
ENV = {"WEBUI_API_KEY": "sk-test"}


@pytest.fixture(scope="module")
def rendered() -> dict:
    r = compose("--profile", "monitoring", "config", "--format", "json", env=ENV)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def mount(service: dict, source: Path) -> str:
    """The container path where `source` (a file or folder of this repo) is bind-mounted."""
    for vol in service.get("volumes", []):
        if vol["type"] == "bind" and Path(vol["source"]) == source:
            assert vol.get("read_only"), f"{source} should be mounted read-only"
            return vol["target"]
    raise AssertionError(f"{source} is not mounted")


def test_profile_config_is_valid_and_adds_two_services():
    r = compose("--profile", "monitoring", "config", "-q", env=ENV)
    assert r.returncode == 0, r.stderr
    plain = json.loads(compose("config", "--format", "json", env=ENV).stdout)["services"]
    with_profile = json.loads(compose("--profile", "monitoring", "config", "--format", "json",
                                      env=ENV).stdout)["services"]
    assert set(with_profile) - set(plain) == {"prometheus", "grafana"}


def test_profile_renders_with_env_example():
    r = compose("--env-file", str(REPO / ".env.example"), "--profile", "monitoring", "config", "--format",
                "json", env=ENV)
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    assert services["grafana"]["ports"][0]["host_ip"] == "127.0.0.1"
    assert "--storage.tsdb.retention.time=15d" in services["prometheus"]["command"]


def test_only_grafana_is_added_to_the_published_ports_on_loopback(rendered):
    published = {name: svc["ports"] for name, svc in rendered["services"].items() if svc.get("ports")}
    assert set(published) == {"proxy", "webui", "grafana"}
    for ports in published.values():
        assert all(p["host_ip"] == "127.0.0.1" for p in ports)
    # The key-less metrics listeners stay on the compose network.
    assert [p["target"] for p in published["proxy"]] == [8080]
    assert "9145" in rendered["services"]["proxy"]["expose"]
    assert not rendered["services"]["prometheus"].get("ports")
    assert not rendered["services"]["vllm"].get("ports")


def test_grafana_bind_and_port_are_settings():
    r = compose("--profile", "monitoring", "config", "--format", "json",
                env={**ENV, "GRAFANA_BIND": "0.0.0.0", "GRAFANA_PORT": "3333", "GRAFANA_ADMIN_PASSWORD": "pw"})
    grafana = json.loads(r.stdout)["services"]["grafana"]
    port = grafana["ports"][0]
    assert (port["host_ip"], port["published"], port["target"]) == ("0.0.0.0", "3333", 3000)
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "pw"


def test_monitoring_services_are_pinned_and_health_checked(rendered):
    for name in ("prometheus", "grafana"):
        svc = rendered["services"][name]
        image, _, tag = svc["image"].rpartition(":")
        assert image and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), svc["image"]
        assert svc["healthcheck"]["test"][0] == "CMD"
        assert svc["profiles"] == ["monitoring"]
    assert rendered["services"]["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_grafana_refuses_to_start_without_a_password(rendered, tmp_path):
    """Run the entrypoint's guard with sh: no password, exit 1 with the fix; a password, on to /run.sh."""
    entry = rendered["services"]["grafana"]["entrypoint"]
    assert entry[:2] == ["sh", "-c"]
    script = entry[2].replace("$$", "$")  # `config` prints a literal $ escaped, as compose.yaml has it
    assert script.rstrip().endswith("exec /run.sh")  # the grafana image's own entrypoint
    script = script.replace("exec /run.sh", "echo started")
    r = subprocess.run(["sh", "-c", script], env={"GF_SECURITY_ADMIN_PASSWORD": ""}, capture_output=True,
                       text=True)
    assert r.returncode == 1 and "GRAFANA_ADMIN_PASSWORD" in r.stderr and "started" not in r.stdout
    r = subprocess.run(["sh", "-c", script], env={"GF_SECURITY_ADMIN_PASSWORD": "pw"}, capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout.strip() == "started"


def test_prometheus_scrapes_services_and_ports_that_exist(rendered):
    prom = rendered["services"]["prometheus"]
    target = mount(prom, MONITORING / "prometheus.yml")
    assert f"--config.file={target}" in prom["command"]
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"vllm", "gateway"}
    targets = {}
    for name, job in jobs.items():
        (static,) = job["static_configs"]
        (targets[name],) = static["targets"]
        assert job.get("metrics_path", "/metrics") == "/metrics"
    assert targets == {"vllm": "vllm:8000", "gateway": "proxy:9145"}
    for hostport in targets.values():
        host, port = hostport.split(":")
        assert host in rendered["services"], f"{host} is not a compose service"
        assert port in rendered["services"][host].get("expose", []), f"{hostport} is not exposed"


def test_gateway_image_listens_where_compose_and_prometheus_expect():
    # proxy/Dockerfile sets run-local.sh's settings: the public port compose publishes, and the metrics
    # listener on every interface of the container (compose exposes 9145, never publishes it).
    env = dict(re.findall(r"(\w+)=(\S+)", (REPO / "proxy" / "Dockerfile").read_text().split("ENV UPSTREAM", 1)[1]
                          .split("EXPOSE", 1)[0].replace("\\\n", " ")))
    assert env["PORT"] == "8080" and env["LISTEN"] == "0.0.0.0"
    assert env["METRICS_PORT"] == "9145" and env["METRICS_LISTEN"] == "0.0.0.0"


def test_grafana_provisioning_fits_the_mounts(rendered):
    grafana = rendered["services"]["grafana"]
    prov = mount(grafana, MONITORING / "grafana" / "provisioning")
    dashboards = mount(grafana, MONITORING / "grafana" / "dashboards")
    assert prov == "/etc/grafana/provisioning"  # Grafana's default provisioning path

    (ds,) = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"]
    assert ds["type"] == "prometheus" and ds["isDefault"]
    host, port = re.fullmatch(r"http://([a-z-]+):(\d+)", ds["url"]).groups()
    assert host == "prometheus" and port in rendered["services"][host]["expose"]

    (provider,) = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/bonsai.yml").read_text())[
        "providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == dashboards
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dashboards + "/")
    assert (MONITORING / "grafana" / "dashboards" / home.removeprefix(dashboards + "/")).is_file()

    # Every panel queries the provisioned datasource by its uid.
    dash = json.loads(DASHBOARD.read_text())
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == ds["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == ds["uid"]


def dashboard_expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_has_the_panels_the_issue_asks_for():
    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for words in ("generation tokens/s", "prompt tokens/s", "running", "waiting", "kv cache", "preemption",
                  "per source", "p50", "p95"):
        assert words in titles, words
    # Panel ids are unique and panels do not overlap on the grid.
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))
        assert g["x"] + g["w"] <= 24


def vllm_series_names() -> set[str]:
    """The series names vLLM 0.32's Prometheus logger registers, as prometheus_client will write them.

    The metric definitions are read from the installed vLLM's source (vllm/v1/metrics/loggers.py); each
    is then created in a private prometheus_client registry, so the suffix rules (_total for counters,
    _bucket/_sum/_count for histograms) are prometheus_client's own, not a copy of them.
    """
    from importlib.util import find_spec

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    # Located, not imported: importing vLLM pulls in torch for nothing here.
    source = (Path(find_spec("vllm").origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    found = re.findall(r"self\._(counter|gauge|histogram)_cls\(\s*name=\"(vllm:[a-z0-9_:]+)\"", source)
    assert len(found) > 30, "the metric definitions in vLLM's loggers.py were not found"
    names: set[str] = set()
    for kind, name in found:
        registry = CollectorRegistry()
        metric = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[kind](name, "doc",
                                                                                 registry=registry)
        if kind == "histogram":
            metric.observe(1.0)
        for family in registry.collect():
            names.update(sample.name for sample in family.samples if not sample.name.endswith("_created"))
    return names


def test_dashboard_vllm_metrics_exist_in_vllm():
    known = vllm_series_names()
    # The check can fail: V0's name for the KV gauge is gone, the counters carry _total.
    assert "vllm:gpu_cache_usage_perc" not in known and "vllm:generation_tokens" not in known
    used = {name for expr in dashboard_expressions() for name in re.findall(r"\bvllm:[a-z0-9_:]+", expr)}
    assert {"vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:num_requests_running",
            "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"} <= used
    assert used <= known, sorted(used - known)


def test_make_monitoring_writes_a_grafana_password_once(tmp_path):
    """`make monitoring` in a copy of the repository, with COMPOSE standing in for docker compose."""
    for name in ("Makefile", ".env.example"):
        shutil.copy(REPO / name, tmp_path / name)
    (tmp_path / "proxy").mkdir()
    shutil.copy(REPO / "proxy" / "add-key", tmp_path / "proxy" / "add-key")

    def make() -> subprocess.CompletedProcess:
        return subprocess.run(["make", "-s", "monitoring", "COMPOSE=echo compose"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)

    r = make()
    assert r.returncode == 0, r.stderr
    assert "compose --profile monitoring up -d" in r.stdout
    env = (tmp_path / ".env").read_text()
    (password,) = re.findall(r"^GRAFANA_ADMIN_PASSWORD=(.*)$", env, re.M)
    assert len(password) >= 20 and password.isalnum()
    r = make()
    assert r.returncode == 0 and "wrote a random GRAFANA_ADMIN_PASSWORD" not in r.stdout
    assert (tmp_path / ".env").read_text() == env  # kept, not replaced


def test_env_example_documents_the_monitoring_settings():
    lines = (REPO / ".env.example").read_text().splitlines()
    for name in ("GRAFANA_BIND", "GRAFANA_PORT", "GRAFANA_ADMIN_PASSWORD", "PROMETHEUS_RETENTION"):
        i = next((n for n, line in enumerate(lines) if line.startswith(f"{name}=")), None)
        assert i is not None, f"{name} missing from .env.example"
        assert lines[i - 1].startswith("#") or lines[i - 2].startswith("#"), name
    compose_text = (REPO / "compose.yaml").read_text()
    for name in ("GRAFANA_BIND", "GRAFANA_PORT", "GRAFANA_ADMIN_PASSWORD", "PROMETHEUS_RETENTION"):
        assert "${" + name in compose_text, name


def test_docs_list_every_gateway_and_dashboard_metric():
    doc = (REPO / "docs" / "monitoring.md").read_text()
    lua = (REPO / "proxy" / "lua" / "gateway" / "metrics.lua").read_text()
    for name in set(re.findall(r'name = "(gateway_[a-z_]+)"', lua)):
        assert f"`{name}`" in doc, name
    for name in {re.sub(r"_(total|bucket)$", "", n) for expr in dashboard_expressions()
                 for n in re.findall(r"\bvllm:[a-z0-9_:]+", expr)}:
        assert f"`{name}" in doc, name


def row_panels(title_word: str) -> list[dict]:
    """The panels under the row whose title holds `title_word`, down to the next row."""
    panels = sorted(json.loads(DASHBOARD.read_text())["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and title_word in p["title"])
    under = []
    for p in panels[start + 1:]:
        if p["type"] == "row":
            break
        under.append(p)
    return under


def test_dashboard_has_a_model_servers_row_per_upstream():
    """Several PCs behind one gateway (docs/scale-out.md): requests, errors, response time and cut streams per
    model server, from the gateway's per-upstream series."""
    panels = row_panels("Model servers")
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in panels}
    assert len(panels) == 4, list(exprs)
    flat = [e for es in exprs.values() for e in es]
    for e in flat:
        assert re.search(r"\bgateway_upstream_(requests_total|response_seconds_bucket|stream_errors_total)\b", e), e
        assert re.search(r"by \(upstream\b", e), e  # one line per model server
    rate = [e for e in flat if "gateway_upstream_requests_total" in e]
    assert len(rate) == 2 and any("gateway_upstream_requests_total[" in e for e in rate)  # all tries, unfiltered
    (errors,) = [e for e in rate if "code" in e]
    assert 'gateway_upstream_requests_total{code=~"5.."}' in errors and "by (upstream, code)" in errors
    quantiles = sorted(re.findall(r"histogram_quantile\((0\.\d+), sum by \(upstream, le\) \(rate\("
                                  r"gateway_upstream_response_seconds_bucket\[", e)[0] for e in flat
                       if "gateway_upstream_response_seconds_bucket" in e)
    assert quantiles == ["0.5", "0.95"]
    assert any("gateway_upstream_stream_errors_total" in e for e in flat)


def test_docs_list_the_dashboards_gateway_metrics():
    # every gateway_* family a panel queries is in docs/monitoring.md (the live names: tests/proxy)
    doc = (REPO / "docs" / "monitoring.md").read_text()
    used = {re.sub(r"_bucket$", "", n) for expr in dashboard_expressions() for n in re.findall(r"\bgateway_[a-z_]+", expr)}
    assert "gateway_upstream_requests_total" in used
    for name in used:
        assert f"`{name}`" in doc, name
