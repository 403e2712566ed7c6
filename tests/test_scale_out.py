"""Several bundles behind one gateway (docs/scale-out.md), the deployment side, checked where no Docker engine
runs: the main PC's compose wiring (UPSTREAMS and the model servers' key), a server PC's override
(compose.server.yaml: vLLM published on the LAN, refused without a key), `make server`, and what vLLM 0.32 and
the pinned Open WebUI do with the settings compose hands them.

The gateway itself (spreading, affinity, failover, its metrics) is tested against real nginx in tests/proxy/.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from test_bundle import REPO, compose

SERVER_FILES = ("compose.yaml", "compose.server.yaml")
ENV = {"WEBUI_API_KEY": "sk-test"}


def render(env: dict[str, str] | None = None, files: tuple[str, ...] = ("compose.yaml",)) -> dict:
    r = compose("config", "--format", "json", env={**ENV, **(env or {})}, files=files)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["services"]


# ---- the main PC: compose.yaml

def test_gateway_defaults_to_the_local_model_server_without_a_key():
    services = render()
    proxy = services["proxy"]["environment"]
    assert proxy["UPSTREAMS"] == "http://vllm:8000"
    assert proxy["UPSTREAM_API_KEY"] == "" and services["vllm"]["environment"]["VLLM_API_KEY"] == ""
    assert proxy["UPSTREAM_FAIL_TIMEOUT"] == "10"
    # the default upstream is a service of this file, on the port it exposes
    host, port = re.fullmatch(r"http://([a-z-]+):(\d+)", proxy["UPSTREAMS"]).groups()
    assert host in services and port in services[host]["expose"]


def test_gateway_takes_the_upstreams_and_the_local_server_asks_for_the_same_key():
    services = render({"UPSTREAMS": "http://vllm:8000,http://192.168.1.23:8000", "UPSTREAM_API_KEY": "k-1",
                       "UPSTREAM_FAIL_TIMEOUT": "30"})
    proxy = services["proxy"]["environment"]
    assert proxy["UPSTREAMS"] == "http://vllm:8000,http://192.168.1.23:8000"
    assert proxy["UPSTREAM_FAIL_TIMEOUT"] == "30"
    assert proxy["UPSTREAM_API_KEY"] == "k-1" == services["vllm"]["environment"]["VLLM_API_KEY"]
    assert not services["vllm"].get("ports")  # the main PC's vLLM stays on the compose network


def test_webui_sends_the_chat_id_the_gateway_keeps_a_conversation_on_one_server_by():
    from bonsai_vllm.testing.devwebui import compose_environment

    assert render()["webui"]["environment"]["ENABLE_FORWARD_USER_INFO_HEADERS"] == "true"
    # the browser tests and `make demo` start Open WebUI with the same switch (read from compose.yaml)
    env = compose_environment({"WEBUI_API_KEY": "k", "WEBUI_SECRET_KEY": "s", "SERVED_MODEL_NAME": "m"})
    assert env["ENABLE_FORWARD_USER_INFO_HEADERS"] == "true"
    assert env["OPENAI_API_KEY"] == "k" and env["DEFAULT_MODELS"] == "m"
    assert not any("${" in v for v in env.values()), env
    # The pinned Open WebUI reads the switch as "true" (case-insensitive) and names the header the gateway
    # hashes X-OpenWebUI-Chat-Id: checked in its source where `make webui-env` installed it.
    found = sorted((REPO / ".webui-venv").glob("lib/python3*/site-packages/open_webui/env.py"))
    if not found:
        pytest.skip("no .webui-venv (make webui-env): Open WebUI's own reading not checked")
    source = found[0].read_text()
    assert re.search(r"ENABLE_FORWARD_USER_INFO_HEADERS = os\.getenv\(\s*'ENABLE_FORWARD_USER_INFO_HEADERS',"
                     r"\s*'False'\s*\)\.lower\(\) == 'true'", source)
    assert re.search(r"FORWARD_SESSION_INFO_HEADER_CHAT_ID = os\.getenv\(\s*'FORWARD_SESSION_INFO_HEADER_CHAT_ID',"
                     r"\s*'X-OpenWebUI-Chat-Id'\s*\)", source)


def vllm_app(monkeypatch, key: str | None):
    """A FastAPI app with the middleware vLLM 0.32's server installs for VLLM_API_KEY=key, and two routes."""
    from fastapi import FastAPI
    from vllm import envs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if key is None:
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("VLLM_API_KEY", key)
    envs.disable_envs_cache()  # read the variable now, as a fresh server process does
    app = FastAPI()
    app.get("/health")(lambda: {"ok": True})
    app.get("/metrics")(lambda: {"ok": True})
    app.get("/v1/models")(lambda: {"data": []})
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])  # no --api-key: bonsai-serve passes none
    init_entrypoints_middleware(args, app, ())
    return app


@pytest.mark.parametrize("key", [None, ""])
def test_vllm_treats_an_empty_key_as_no_key(monkeypatch, key):
    # compose hands the vllm service VLLM_API_KEY="" on a single PC: that must not become a key "" to match
    from starlette.testclient import TestClient

    client = TestClient(vllm_app(monkeypatch, key))
    assert client.get("/v1/models").status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer anything"}).status_code == 200


def test_vllm_with_a_key_guards_v1_only(monkeypatch):
    # /health (compose's healthcheck) and /metrics (Prometheus) must answer without it
    from starlette.testclient import TestClient

    client = TestClient(vllm_app(monkeypatch, "k-1"))
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k-2"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer k-1"}).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


# ---- a server PC: compose.yaml + compose.server.yaml

def test_server_override_runs_the_model_server_alone_published_on_the_lan():
    services = render(files=SERVER_FILES)
    assert set(services) == {"model-fetch", "vllm"}  # no gateway, no web UI on a server PC
    (port,) = services["vllm"]["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("0.0.0.0", "8000", 8000)
    # everything else of the service is compose.yaml's: the same knobs, checks and dependency
    main = render()["vllm"]
    for key in ("environment", "volumes", "healthcheck", "depends_on", "deploy", "cap_add", "ipc"):
        assert services["vllm"][key] == main[key], key


def test_server_bind_and_port_are_settings():
    services = render({"SERVER_BIND": "127.0.0.1", "SERVER_PORT": "8001", "UPSTREAM_API_KEY": "k-1"},
                      files=SERVER_FILES)
    (port,) = services["vllm"]["ports"]
    assert (port["host_ip"], port["published"], port["target"]) == ("127.0.0.1", "8001", 8000)
    assert services["vllm"]["environment"]["VLLM_API_KEY"] == "k-1"


def test_server_override_renders_with_env_example_and_commands_work_without_a_key():
    # `make logs`, `down`, `ps` must work before a key exists: only the container refuses to start
    r = compose("--env-file", str(REPO / ".env.example"), "config", "-q", files=SERVER_FILES)
    assert r.returncode == 0, r.stderr


def run_entrypoint(entrypoint: list[str], key: str | None, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The container's start: the entrypoint with `args` (compose's command), a stand-in for bonsai-serve
    on PATH that prints what it was given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "bonsai-serve"
    fake.write_text('#!/bin/sh\necho "bonsai-serve started with: $*"\n')
    fake.chmod(0o755)
    argv = [part.replace("$$", "$") for part in entrypoint]  # what the container gets ($$ escapes $ in compose)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"} | ({} if key is None else {"VLLM_API_KEY": key})
    return subprocess.run([*argv, *args], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("key", [None, ""])
def test_server_refuses_to_start_without_a_key(tmp_path, key):
    entrypoint = render(files=SERVER_FILES)["vllm"]["entrypoint"]
    assert entrypoint[:2] == ["sh", "-c"]
    r = run_entrypoint(entrypoint, key, tmp_path)
    assert r.returncode == 1 and "started" not in r.stdout
    assert "UPSTREAM_API_KEY" in r.stderr and "make server" in r.stderr  # names the setting and the fix


def test_server_with_a_key_starts_bonsai_serve_with_compose_arguments(tmp_path):
    entrypoint = render({"UPSTREAM_API_KEY": "k-1"}, files=SERVER_FILES)["vllm"]["entrypoint"]
    r = run_entrypoint(entrypoint, "k-1", tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "bonsai-serve started with:", r.stderr
    # `docker compose -f ... run --rm vllm --check` still reaches bonsai-serve's own flags, word by word
    r = run_entrypoint(entrypoint, "k-1", tmp_path, "--check", "two words")
    assert r.returncode == 0 and r.stdout.strip() == "bonsai-serve started with: --check two words", r.stderr
    # ... and bonsai-serve is what the image would have run without the override
    assert re.search(r'^ENTRYPOINT \["bonsai-serve"\]$', (REPO / "Dockerfile").read_text(), re.M)


# ---- make server

def copy_for_make(tmp_path: Path) -> Path:
    for name in ("Makefile", ".env.example", *SERVER_FILES):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def clean_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the settings under test, nor the MAKEFLAGS / MAKELEVEL / MFLAGS that
    `make test` hands down (with them a make here is a sub-make and prints "Entering directory" lines)."""
    import os

    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("UPSTREAM", "SERVER_", "MAKE")) and k not in ("MFLAGS", "MAKEOVERRIDES")}
    return {**base, **(env or {})}


def make(cwd: Path, *targets: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", *targets, "COMPOSE=echo compose"], cwd=cwd, capture_output=True,
                          text=True, timeout=60, env=clean_env(env))


def dotenv(path: Path, name: str) -> list[str]:
    return re.findall(rf"^{name}=(.*)$", path.read_text(), re.M)


def test_make_server_writes_a_key_once_and_prints_what_the_main_pc_needs(tmp_path):
    cwd = copy_for_make(tmp_path)
    r = make(cwd, "server")
    assert r.returncode == 0, r.stderr
    (key,) = dotenv(cwd / ".env", "UPSTREAM_API_KEY")  # replaced in place: one line, not a second one
    assert len(key) >= 32 and key.isalnum()
    lines = [line.strip() for line in r.stdout.splitlines()]
    assert f"UPSTREAM_API_KEY={key}" in lines
    assert "UPSTREAMS=http://vllm:8000,http://<this PC's LAN address>:8000" in lines
    assert "make lan-server" in r.stdout
    # model-fetch + vllm through the override, after the lines to paste (`up` waits for the download)
    up = "compose -f compose.yaml -f compose.server.yaml up -d --build vllm"
    assert up in lines and lines.index(up) > lines.index(f"UPSTREAM_API_KEY={key}")
    assert not (cwd / "proxy").exists()  # a server PC needs no gateway keys
    env_text = (cwd / ".env").read_text()
    r = make(cwd, "server")
    assert r.returncode == 0 and "wrote a random UPSTREAM_API_KEY" not in r.stdout
    assert (cwd / ".env").read_text() == env_text and f"UPSTREAM_API_KEY={key}" in r.stdout  # kept, shown again


def test_make_server_keeps_a_key_copied_from_another_pc_and_reads_the_port_from_env(tmp_path):
    cwd = copy_for_make(tmp_path)
    text = (REPO / ".env.example").read_text()
    text = re.sub(r"^UPSTREAM_API_KEY=.*$", "UPSTREAM_API_KEY=from-the-first-server", text, flags=re.M)
    text = re.sub(r"^SERVER_PORT=.*$", "SERVER_PORT=8001", text, flags=re.M)
    (cwd / ".env").write_text(text)
    r = make(cwd, "server")
    assert r.returncode == 0, r.stderr
    assert dotenv(cwd / ".env", "UPSTREAM_API_KEY") == ["from-the-first-server"]
    assert "UPSTREAM_API_KEY=from-the-first-server" in r.stdout
    assert "UPSTREAMS=http://vllm:8000,http://<this PC's LAN address>:8001" in r.stdout
    # the environment wins over .env, as it does for compose
    r = make(cwd, "server", env={"SERVER_PORT": "8002"})
    assert ":8002" in r.stdout and ":8001" not in r.stdout
    # make lan-server forwards the same port
    r = subprocess.run(["make", "-n", "lan-server"], cwd=cwd, capture_output=True, text=True, timeout=60,
                       env=clean_env())
    assert r.stdout.strip() == "wsl/lan --server --port 8001", r.stdout + r.stderr


def test_make_server_adds_the_key_line_when_env_has_none(tmp_path):
    cwd = copy_for_make(tmp_path)
    (cwd / ".env").write_text("SERVED_MODEL_NAME=bonsai-27b\n")  # an .env from before UPSTREAM_API_KEY existed
    r = make(cwd, "server")
    assert r.returncode == 0, r.stderr
    (key,) = dotenv(cwd / ".env", "UPSTREAM_API_KEY")
    assert len(key) >= 32 and f"UPSTREAM_API_KEY={key}" in r.stdout
    assert "SERVED_MODEL_NAME=bonsai-27b" in (cwd / ".env").read_text()


def test_make_help_lists_the_server_targets():
    r = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    listed = {re.sub(r"\x1b\[[0-9;]*m", "", line).split()[0] for line in r.stdout.splitlines() if line.strip()}
    assert {"server", "lan-server", "lan-server-remove"} <= listed


def test_env_example_documents_the_scale_out_settings():
    lines = (REPO / ".env.example").read_text().splitlines()
    names = ("UPSTREAMS", "UPSTREAM_API_KEY", "UPSTREAM_FAIL_TIMEOUT", "SERVER_BIND", "SERVER_PORT")
    for name in names:
        i = next((n for n, line in enumerate(lines) if line.startswith(f"{name}=")), None)
        assert i is not None, f"{name} missing from .env.example"
        assert lines[i - 1].startswith("#") or lines[i - 2].startswith("#"), name
    assert "UPSTREAM_API_KEY=" in lines  # empty: a single PC needs no key
    text = (REPO / "compose.yaml").read_text() + (REPO / "compose.server.yaml").read_text()
    for name in names:
        assert "${" + name in text, name
