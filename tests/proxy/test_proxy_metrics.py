"""The gateway's Prometheus metrics (proxy/lua/gateway/metrics.lua): per-source request counts and
latency histograms on a separate loopback listener, never on the public port, never a key.

Each test that counts starts its own gateway, so its numbers hold only the requests it sent.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections import defaultdict

import pytest
import requests

from gateway_harness import KEYS, REPO, auth, keys_text
from test_proxy_config import run_local

DASHBOARD = REPO / "monitoring" / "grafana" / "dashboards" / "bonsai.json"

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)"(,|$)')


def parse_exposition(text: str) -> tuple[dict[str, dict], list[tuple[str, dict[str, str], float]]]:
    """A strict reader of the text format: every sample line must parse and belong to a family whose
    # HELP and # TYPE came first. Returns ({family: {"help", "type"}}, [(name, labels, value)])."""
    families: dict[str, dict] = {}
    samples = []
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert name not in families, f"second HELP for {name}"
            families[name] = {"help": help_text}
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            assert name in families and "type" not in families[name], f"TYPE of {name} without HELP first"
            families[name]["type"] = kind
        else:
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            name, raw_labels, value = m.groups()
            labels: dict[str, str] = {}
            if raw_labels:
                pos = 0
                while pos < len(raw_labels):
                    lm = LABEL.match(raw_labels, pos)
                    assert lm, f"bad labels in {line!r}"
                    labels[lm.group(1)] = lm.group(2)
                    pos = lm.end()
            family = name
            if name not in families:
                family = re.sub(r"_(bucket|sum|count)$", "", name)
                assert families.get(family, {}).get("type") == "histogram", f"{name}: no family"
            assert "type" in families[family], f"{name} before its TYPE"
            samples.append((name, labels, float(value)))
    return families, samples


def scrape(gw) -> str:
    resp = requests.get(gw.metrics_url, timeout=5)
    assert resp.status_code == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return resp.text


def request_counts(samples) -> dict[tuple[str, str], int]:
    return {(lab["source"], lab["code"]): int(v) for name, lab, v in samples if name == "gateway_requests_total"}


def wait_for_total(gw, total: int, timeout: float = 5.0) -> str:
    """The log phase runs after the answer left: poll until every request sent has been counted."""
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(gw)
        counted = sum(request_counts(parse_exposition(text)[1]).values())
        if counted >= total or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def histograms(samples, family: str) -> dict[str, dict]:
    """{source: {"buckets": [(le, count)] in exposition order, "sum": x, "count": n}}"""
    out: dict[str, dict] = defaultdict(lambda: {"buckets": []})
    for name, lab, v in samples:
        if name == family + "_bucket":
            out[lab["source"]]["buckets"].append((float(lab["le"]), v))
        elif name == family + "_sum":
            out[lab["source"]]["sum"] = v
        elif name == family + "_count":
            out[lab["source"]]["count"] = v
    return dict(out)


def send_traffic(gw) -> dict[tuple[str, str], int]:
    """Two sources with keys, one unknown key, no key; returns what the counters must say."""
    url = gw.url + "/v1/chat/completions"
    for _ in range(3):
        assert requests.post(url, data=b'{"model":"m"}', headers=auth("ui")).status_code == 200
    # A stream too: counted once, when it ends.
    resp = requests.post(url, data=b'{"model":"m","stream":true}',
                         headers={**auth("ui"), "X-Stub-Chunks": "3", "X-Stub-Delay": "0.05"})
    assert resp.status_code == 200 and resp.text.rstrip().endswith("[DONE]")
    for _ in range(2):
        assert requests.get(gw.url + "/v1/models", headers=auth("agent")).status_code == 200
    # The model server's own error passes through and is counted with its status.
    resp = requests.post(url, data=b'{"model":"m"}', headers={**auth("agent"), "X-Stub-Status": "503"})
    assert resp.status_code == 503
    # Refused by the gateway itself (bad body) under a known key.
    assert requests.post(url, data=b'[1]', headers=auth("agent")).status_code == 400
    for _ in range(2):
        resp = requests.post(url, data=b"{}", headers={"Authorization": "Bearer sk-not-a-key-123"})
        assert resp.status_code == 401
    assert requests.post(url, data=b"{}").status_code == 401
    # Not counted: the health check compose polls.
    for _ in range(3):
        assert requests.get(gw.url + "/healthz").status_code == 200
    return {("openwebui", "200"): 4, ("agents", "200"): 2, ("agents", "503"): 1, ("agents", "400"): 1,
            ("rejected", "401"): 2, ("anonymous", "401"): 1}


@pytest.fixture
def counted(stub, keys_file, make_gateway):
    gw = make_gateway(stub.url, keys_file)
    expected = send_traffic(gw)
    text = wait_for_total(gw, sum(expected.values()))
    return gw, expected, text


def test_counts_per_source_and_status_are_exact(counted):
    gw, expected, text = counted
    families, samples = parse_exposition(text)
    assert families["gateway_requests_total"]["type"] == "counter"
    assert request_counts(samples) == expected
    # Nothing arrives late: the numbers stay as they are.
    time.sleep(0.3)
    assert request_counts(parse_exposition(scrape(gw))[1]) == expected


def test_latency_histograms_are_cumulative_and_complete(counted):
    _, expected, text = counted
    families, samples = parse_exposition(text)
    per_source = defaultdict(int)
    for (source, _), n in expected.items():
        per_source[source] += n
    # Requests that reached the model server: all but the gateway's own 400 and 401s.
    reached = {"openwebui": 4, "agents": 3}

    for family, want in (("gateway_request_duration_seconds", dict(per_source)),
                         ("gateway_upstream_first_byte_seconds", reached)):
        assert families[family]["type"] == "histogram"
        hist = histograms(samples, family)
        assert {s: int(h["count"]) for s, h in hist.items()} == want, family
        for source, h in hist.items():
            les = [le for le, _ in h["buckets"]]
            assert les == sorted(les) and len(set(les)) == len(les), (family, source)
            assert les[-1] == math.inf, "the last bucket is +Inf"
            counts = [c for _, c in h["buckets"]]
            assert all(a <= b for a, b in zip(counts, counts[1:])), f"{family}{{{source}}} not cumulative"
            assert counts[-1] == h["count"], "+Inf bucket equals _count"
            assert 0 <= h["sum"] < 5 * h["count"]

    # The stream took at least 3 × 50 ms, so one openwebui request is above 0.1 s, and none above 5 s.
    duration = dict(histograms(samples, "gateway_request_duration_seconds")["openwebui"]["buckets"])
    assert duration[0.1] <= 3 and duration[5.0] == 4


def test_output_reads_as_prometheus_text(counted):
    # prometheus_client's own parser (vLLM depends on it) must read the same families.
    from prometheus_client.parser import text_string_to_metric_families

    _, expected, text = counted
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert parsed["gateway_requests"].type == "counter"
    assert parsed["gateway_request_duration_seconds"].type == "histogram"
    total = sum(s.value for s in parsed["gateway_requests"].samples if s.name == "gateway_requests_total")
    assert total == sum(expected.values())


def test_no_key_material_in_metrics(counted):
    _, _, text = counted
    for k, *_ in KEYS.values():
        assert k not in text
        assert hashlib.md5(k.encode()).hexdigest()[:10] not in text  # nor the log's key_id
    assert "sk-not-a-key-123" not in text
    _, samples = parse_exposition(text)
    # Labels stay a small fixed set: sources, statuses, buckets, and the model servers' addresses.
    assert {name for _, lab, _ in samples for name in lab} <= {"source", "code", "le", "upstream"}
    addrs = {lab["upstream"] for s, lab, _ in samples if s.startswith("gateway_upstream_requests")}
    assert addrs and all(re.fullmatch(r"127\.0\.0\.1:\d+", a) for a in addrs), addrs


def test_public_port_does_not_serve_metrics(counted):
    gw, _, _ = counted
    for headers in ({}, auth("agent")):
        resp = requests.get(gw.url + "/metrics", headers=headers)
        assert resp.status_code == 404 and "gateway_requests_total" not in resp.text
    assert gw.metrics_port != gw.port


def test_metrics_listener_serves_nothing_else_and_stays_on_loopback(stub, keys_file, make_gateway):
    # Even with the API on every interface, the key-less listener binds loopback only.
    gw = make_gateway(stub.url, keys_file, {"LISTEN": "0.0.0.0"})
    conf = (gw.run_dir / "nginx.conf").read_text()
    assert f"listen 0.0.0.0:{gw.port};" in conf
    assert f"listen 127.0.0.1:{gw.metrics_port};" in conf
    before = len(stub.seen)
    base = f"http://127.0.0.1:{gw.metrics_port}"
    assert requests.get(base + "/v1/models", headers=auth("agent")).status_code == 404
    assert requests.post(base + "/metrics", data=b"x").status_code == 405
    assert len(stub.seen) == before
    # Its own scrapes are not counted.
    for _ in range(3):
        scrape(gw)
    assert request_counts(parse_exposition(scrape(gw))[1]) == {}


def test_counters_survive_a_reload(stub, tmp_path, make_gateway):
    keys = tmp_path / "keys"
    keys.write_text(keys_text(["agent"]))
    gw = make_gateway(stub.url, keys)
    for _ in range(2):
        assert requests.get(gw.url + "/v1/models", headers=auth("agent")).status_code == 200
    assert request_counts(parse_exposition(wait_for_total(gw, 2))[1]) == {("agents", "200"): 2}
    result = gw.reload()
    assert result.returncode == 0, result.stderr
    time.sleep(0.5)  # new workers up
    assert requests.get(gw.url + "/v1/models", headers=auth("agent")).status_code == 200
    assert request_counts(parse_exposition(wait_for_total(gw, 3))[1]) == {("agents", "200"): 3}


def test_run_local_metrics_port_settings(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(keys_text(["agent"]))
    result = run_local(tmp_path, KEYS=str(keys), UPSTREAM="http://127.0.0.1:9", PORT="18080",
                       METRICS_PORT="18080")
    assert result.returncode == 2 and "METRICS_PORT must differ from PORT" in result.stderr
    result = run_local(tmp_path, KEYS=str(keys), UPSTREAM="http://127.0.0.1:9", METRICS_PORT="on")
    assert result.returncode == 2 and "METRICS_PORT must be a number or off" in result.stderr


def test_metrics_can_be_turned_off(stub, keys_file, make_gateway):
    gw = make_gateway(stub.url, keys_file, {"METRICS_PORT": "off"})
    assert "metrics.conf" not in (gw.run_dir / "nginx.conf").read_text()
    assert requests.get(gw.url + "/v1/models", headers=auth("agent")).status_code == 200
    with pytest.raises(requests.ConnectionError):
        requests.get(gw.metrics_url, timeout=2)


def test_metrics_listener_address_is_a_setting(stub, keys_file, make_gateway):
    """METRICS_LISTEN: the gateway image listens on every interface of its container (compose exposes 9145
    to Prometheus, never publishes it); by default, loopback only."""
    gw = make_gateway(stub.url, keys_file, {"METRICS_LISTEN": "127.0.0.2"})
    assert requests.get(gw.url + "/v1/models", headers=auth("bench")).status_code == 200
    port = gw.metrics_url.rsplit(":", 1)[1].split("/")[0]
    deadline = time.monotonic() + 5
    while True:
        text = requests.get(f"http://127.0.0.2:{port}/metrics", timeout=5).text
        counts = request_counts(parse_exposition(text)[1])
        if counts or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert counts == {("benchmarks", "200"): 1}
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
    assert requests.get(gw.url + "/metrics").status_code == 404
def dashboard_expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_gateway_metrics_are_exposed(counted):
    """Every gateway_* series a Grafana panel queries is one the live gateway serves."""
    _, _, text = counted
    _, samples = parse_exposition(text)
    served = {name for name, _, _ in samples}
    used = {name for expr in dashboard_expressions() for name in re.findall(r"\bgateway_[a-z_]+", expr)}
    assert {"gateway_requests_total", "gateway_request_duration_seconds_bucket",
            "gateway_upstream_first_byte_seconds_bucket"} <= used
    assert used <= served, used - served
    # The labels the panels group by exist on those series.
    for label in {lab for expr in dashboard_expressions() if "gateway_" in expr
                  for lab in re.findall(r"by \(([^)]*)\)", expr)}:
        for name in (n.strip() for n in label.split(",")):
            assert any(name in lab for s, lab, _ in samples if s.startswith("gateway_")), name
