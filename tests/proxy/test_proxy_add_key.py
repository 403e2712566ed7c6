"""`proxy/add-key` (make keys): the key it writes is accepted by a real gateway with the right priority."""

from __future__ import annotations

import json
import re
import subprocess

import requests

from gateway_harness import REPO, Gateway


def add_key(tmp_path, *args):
    env = {"KEYS": str(tmp_path / "keys"), "ENV_FILE": str(tmp_path / ".env"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([str(REPO / "proxy" / "add-key"), *args], capture_output=True, text=True, env=env)
    return r, re.search(r"sk-[A-Za-z0-9]{20,}", r.stdout)


def test_new_keys_work_through_the_gateway(tmp_path, stub):
    r, ui = add_key(tmp_path, "openwebui", "0")
    assert r.returncode == 0 and ui, r.stderr
    r, agent = add_key(tmp_path, "agents", "5", "concurrent=8")
    assert r.returncode == 0 and agent and agent.group() != ui.group()
    assert f"WEBUI_API_KEY={ui.group()}" in (tmp_path / ".env").read_text()
    assert (tmp_path / "keys").stat().st_mode & 0o077 == 0  # keys are secrets: owner-only

    gw = Gateway(tmp_path / "gw", stub.url, tmp_path / "keys").start()
    try:
        for match, prio in ((ui, 0), (agent, 5)):
            resp = requests.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "x"},
                                 headers={"Authorization": f"Bearer {match.group()}"}, timeout=10)
            assert resp.status_code == 200, resp.text
            seen = stub.find(resp.headers["X-Request-Id"])
            assert json.loads(seen.body)["priority"] == prio
    finally:
        gw.stop()


def test_bad_arguments_are_refused(tmp_path):
    assert add_key(tmp_path, "agents")[0].returncode == 2
    assert add_key(tmp_path, "bad name!", "5")[0].returncode == 2
    assert add_key(tmp_path, "agents", "high")[0].returncode == 2
    assert not (tmp_path / "keys").exists()
