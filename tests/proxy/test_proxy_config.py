"""The configuration pieces: run-local.sh's checks, keys-file errors at start, and that the shared files
hold nothing but what the rendered main config includes."""

from __future__ import annotations

import os
import subprocess

import requests

from gateway_harness import REPO, keys_text, run_local_command

PROXY = REPO / "proxy"


def run_local(tmp_path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "RUN_DIR": str(tmp_path / "run"), "PORT": "1", **env}
    return subprocess.run(run_local_command(), env=full, capture_output=True, text=True, timeout=10)


def test_bad_keys_file_stops_start_with_line_number(tmp_path):
    keys = tmp_path / "keys"
    secret = "sk-test-never-print-me-123456"
    keys.write_text(keys_text(["agent"], extra=f"{secret} agents\n"))
    result = run_local(tmp_path, KEYS=str(keys), UPSTREAM="http://127.0.0.1:9")
    assert result.returncode != 0
    assert "line 4: expected at least 3 fields" in result.stderr
    assert secret not in result.stderr


def test_duplicate_key_and_unknown_option_are_refused(tmp_path):
    keys = tmp_path / "keys"
    for extra, message in [("sk-a x 1\nsk-a y 2\n", "line 5: the same key is already on line 4"),
                           ("sk-b x 1 burst=3\n", "line 4: unknown option 'burst=3'")]:
        keys.write_text(keys_text(["agent"], extra=extra))
        result = run_local(tmp_path, KEYS=str(keys), UPSTREAM="http://127.0.0.1:9")
        assert result.returncode != 0
        assert message in result.stderr


def test_run_local_refuses_bad_upstream_and_missing_keys(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(keys_text())
    result = run_local(tmp_path, KEYS=str(keys), UPSTREAM="https://example:443/v1")
    assert result.returncode == 2 and "UPSTREAMS must be a comma-separated list of http://host:port" in result.stderr
    result = run_local(tmp_path, KEYS=str(tmp_path / "nope"), UPSTREAM="http://127.0.0.1:9")
    assert result.returncode == 2 and "cannot read keys file" in result.stderr


def test_keys_example_loads(stub, make_gateway):
    # The shipped example must be a valid keys file (`make proxy KEYS=proxy/keys.example`).
    gw = make_gateway(stub.url, PROXY / "keys.example")
    assert "3 keys from" in gw.stderr()
    resp = requests.post(gw.url + "/v1/chat/completions", data=b'{"model":"m"}',
                         headers={"Authorization": "Bearer sk-example-agents-00000000000000000000"})
    assert stub.find(resp.headers["X-Request-Id"]).body == b'{"priority":5,"model":"m"}'


def test_shared_files_hold_no_debian_only_lines():
    for path in list((PROXY / "conf").glob("*.conf")):
        for line in path.read_text().splitlines():
            assert not line.strip().startswith(("load_module", "env ", "lua_package_path")), (path, line)
