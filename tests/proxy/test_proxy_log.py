"""The access log: one JSON line per request with source, priority, status, latency, bytes, stream;
never a key."""

from __future__ import annotations

import re

import requests

from gateway_harness import KEYS, UPSTREAM_SECRET, auth


def test_log_line_fields(gateway, stub):
    body = b'{"model":"m","priority":7,"messages":[]}'
    resp = requests.post(gateway.url + "/v1/chat/completions", data=body, headers=auth("agent"))
    assert resp.status_code == 200
    entry = gateway.log_entry(resp.headers["X-Request-Id"])
    assert entry["source"] == "agents"
    assert entry["priority"] == 7  # the effective one: the caller asked for less than its key's 5
    assert entry["status"] == 200
    assert entry["stream"] is False
    assert entry["method"] == "POST" and entry["path"] == "/v1/chat/completions"
    assert isinstance(entry["latency_s"], float) and 0 <= entry["latency_s"] < 5
    assert entry["bytes_in"] >= len(body)
    assert entry["bytes_out"] >= len(resp.content)
    assert re.fullmatch(r"[0-9a-f]{10}", entry["key_id"])
    assert entry["error"] == "-"


def test_log_line_for_rejected_request(gateway):
    resp = requests.get(gateway.url + "/v1/models", headers={"Authorization": "Bearer sk-wrong-key-0000"})
    entry = gateway.log_entry(resp.headers["X-Request-Id"])
    assert (entry["status"], entry["source"], entry["priority"], entry["error"]) == (
        401, "-", None, "invalid_api_key")


def test_different_keys_of_one_source_have_different_ids(gateway):
    ids = set()
    for name in ("one", "one_errors"):  # both are source "single"
        resp = requests.get(gateway.url + "/v1/models", headers=auth(name))
        ids.add(gateway.log_entry(resp.headers["X-Request-Id"])["key_id"])
    assert len(ids) == 2


def test_no_key_in_any_log(gateway):
    # Make sure there is something to look at, including a failed key.
    for name in KEYS:
        requests.get(gateway.url + "/v1/models", headers=auth(name))
    resp = requests.get(gateway.url + "/v1/models", headers={"Authorization": "Bearer sk-unknown-secret-9"})
    gateway.log_entry(resp.headers["X-Request-Id"])
    text = gateway.access_log.read_text() + gateway.stderr()
    assert len(gateway.log_entries()) >= len(KEYS) + 1
    for secret in [k for k, *_ in KEYS.values()] + [UPSTREAM_SECRET, "sk-unknown-secret-9"]:
        assert secret not in text
