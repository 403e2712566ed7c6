"""The configuration pieces: run-local.sh's checks, keys-file errors at start, and the OpenResty main
config, which must fit the same shared files (checked here with `nginx -t` on Debian's nginx)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time

import requests

from gateway_harness import REPO, RUN_LOCAL, auth, free_port, keys_text

PROXY = REPO / "proxy"


def run_local(tmp_path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "RUN_DIR": str(tmp_path / "run"), "PORT": "1", **env}
    return subprocess.run([str(RUN_LOCAL)], env=full, capture_output=True, text=True, timeout=10)


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
    assert result.returncode == 2 and "UPSTREAM must look like" in result.stderr
    result = run_local(tmp_path, KEYS=str(tmp_path / "nope"), UPSTREAM="http://127.0.0.1:9")
    assert result.returncode == 2 and "cannot read keys file" in result.stderr


def test_keys_example_loads(stub, make_gateway):
    # The shipped example must be a valid keys file (`make proxy KEYS=proxy/keys.example`).
    gw = make_gateway(stub.url, PROXY / "keys.example")
    assert "3 keys from" in gw.stderr()
    resp = requests.post(gw.url + "/v1/chat/completions", data=b'{"model":"m"}',
                         headers={"Authorization": "Bearer sk-example-agents-00000000000000000000"})
    assert stub.find(resp.headers["X-Request-Id"]).body == b'{"priority":5,"model":"m"}'


def render_openresty(tmp_path, upstream: str, port: int, metrics_port: int | None = None):
    """proxy/openresty.conf with its container paths pointed at this checkout, its two listeners on
    loopback ports and the two load_module lines Debian's nginx needs (the only lines OpenResty would
    refuse)."""
    text = (PROXY / "openresty.conf").read_text()
    assert "load_module" not in text.replace("No load_module lines", "")
    text = text.replace("/usr/local/openresty/nginx/conf/gateway", str(PROXY))
    text = text.replace("/usr/local/openresty/nginx/logs/nginx.pid", str(tmp_path / "nginx.pid"))
    text = text.replace("server vllm:8000", f"server {upstream}")
    text = text.replace("listen 8080;", f"listen 127.0.0.1:{port};")
    assert "listen 9145;" in text
    text = text.replace("listen 9145;", f"listen 127.0.0.1:{metrics_port or free_port()};")
    (tmp_path / "t").mkdir(exist_ok=True)
    for temp in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        text = text.replace("http {", f"http {{\n    {temp}_temp_path {tmp_path}/t/{temp};", 1)
    conf = tmp_path / "nginx.conf"
    conf.write_text("load_module /usr/lib/nginx/modules/ndk_http_module.so;\n"
                    "load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;\n" + text)
    return conf


@contextlib.contextmanager
def openresty_gateway(tmp_path, stub, metrics_port: int | None = None):
    """Run proxy/openresty.conf itself (container paths pointed here, load_module lines added) in front of
    `stub`; yields the public URL once /healthz answers. Its stdout+stderr go to tmp_path/out.log."""
    port = free_port()
    conf = render_openresty(tmp_path, stub.url.removeprefix("http://"), port, metrics_port)
    keys = tmp_path / "keys"
    keys.write_text(keys_text())
    out = open(tmp_path / "out.log", "wb")
    proc = subprocess.Popen(["nginx", "-p", f"{tmp_path}/", "-c", str(conf), "-e", "stderr"],
                            env={**os.environ, "PROXY_KEYS_FILE": str(keys)}, stdout=out, stderr=out)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None, (tmp_path / "out.log").read_text()
            try:
                requests.get(url + "/healthz", timeout=1)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        out.close()


def test_openresty_main_config_serves_with_the_shared_files(stub, tmp_path):
    with openresty_gateway(tmp_path, stub) as url:
        resp = requests.post(url + "/v1/chat/completions", data=b'{"stop":[]}', headers=auth("bench"))
        assert stub.find(resp.headers["X-Request-Id"]).body == b'{"priority":10,"stop":[]}'
    # Its access log goes to stdout, as `docker compose logs` expects.
    assert '"source":"benchmarks"' in (tmp_path / "out.log").read_text()


def test_shared_files_hold_no_debian_only_lines():
    for path in list((PROXY / "conf").glob("*.conf")):
        for line in path.read_text().splitlines():
            assert not line.strip().startswith(("load_module", "env ", "lua_package_path")), (path, line)
