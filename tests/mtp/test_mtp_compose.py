"""The MTP retraining steps as the GPU PC runs them (docs/mtp.md): compose's profile `mtp`, rendered by the
real Compose binary, its extraction server's entrypoint run for real (with the real `bonsai-mtp-train`, and
`bonsai-serve` replaced by a stand-in that records the environment it was started with), and make's mtp-*
targets with `docker compose` replaced by a stand-in that records its calls and can fail one of them.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bonsai_vllm.serve import build_command
from test_bundle import REPO, compose

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def services() -> dict:
    r = compose("--profile", "mtp", "--env-file", str(REPO / ".env.example"), "config", "--format", "json",
                env={"WEBUI_API_KEY": "k", "UPSTREAM_API_KEY": "upstream-secret"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["services"]


def test_the_mtp_services_start_only_when_asked_for():
    r = compose("config", "--services", env={"WEBUI_API_KEY": "k"})
    assert r.returncode == 0, r.stderr
    assert not {"mtp-extract", "mtp-train"} & set(r.stdout.split())  # `make up` never starts them


def test_the_extraction_server_is_the_served_model_without_mtp(services):
    vllm, ex = services["vllm"], services["mtp-extract"]
    changed = {k for k in vllm["environment"] if ex["environment"].get(k) != vllm["environment"][k]}
    # the same model, parallelism, KV cache and plugin switches, except: no MTP (the extraction takes vLLM's
    # one speculative slot), a whole sequence per batch (no chunked prefill), and no key (never published)
    assert changed == {"MTP", "MAX_MODEL_LEN", "MAX_BATCHED_TOKENS", "VLLM_API_KEY"}, changed
    assert ex["environment"]["MTP"] == "0" and ex["environment"]["VLLM_API_KEY"] == ""
    assert ex["environment"]["MAX_MODEL_LEN"] == ex["environment"]["MAX_BATCHED_TOKENS"] == "4096"
    assert ex["deploy"] == vllm["deploy"] and ex["ipc"] == "host" and "SYS_PTRACE" in ex["cap_add"]
    assert not ex.get("ports") and ex["healthcheck"]["test"] == vllm["healthcheck"]["test"]
    mounts = {v["target"]: v for v in ex["volumes"]}
    assert mounts["/models"]["read_only"] and not mounts["/mtp"].get("read_only")


def test_the_trainer_writes_into_the_models_volume_and_sees_the_extracted_states(services):
    tr, ex = services["mtp-train"], services["mtp-extract"]
    assert tr["entrypoint"] == ["bonsai-mtp-train"] and tr["restart"] == "no" and tr["healthcheck"]["disable"]
    mounts = {v["target"]: v for v in tr["volumes"]}
    assert not mounts["/models"].get("read_only")  # the head goes to /models/mtp-head, where model-fetch reads
    # extract moves the files the server wrote: both see one mtp-work volume at the same path
    assert mounts["/mtp"]["source"] == {v["target"]: v for v in ex["volumes"]}["/mtp"]["source"] == "mtp-work"
    assert tr["environment"]["MODEL_DIR"] == "/models/bonsai"
    assert tr["environment"]["SERVED_MODEL_NAME"] == (services["vllm"]["environment"]["SERVED_MODEL_NAME"]
                                                      or "bonsai-27b")  # empty there: bonsai-serve's default
    assert tr["deploy"] == services["vllm"]["deploy"]  # train runs on the GPUs


def test_the_extraction_entrypoint_starts_bonsai_serve_with_the_extraction_flags(services, tmp_path):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 64}}))
    stand_in = tmp_path / "bin"
    stand_in.mkdir()
    record = tmp_path / "serve-env.json"
    (stand_in / "bonsai-serve").write_text(
        f"#!{sys.executable}\nimport json, os\njson.dump(dict(os.environ), open({str(record)!r}, 'w'))\n")
    (stand_in / "bonsai-serve").chmod(0o755)
    ex = services["mtp-extract"]
    script = ex["entrypoint"][-1].replace("$$", "$")  # what the container gets ($$ escapes $ in compose)
    env = {**{k: str(v) for k, v in ex["environment"].items()}, "MODEL_DIR": str(model),
           "VLLM_EXTRA_ARGS": "--seed 3", "PATH": f"{stand_in}:{BIN}:/usr/bin:/bin"}
    r = subprocess.run(ex["entrypoint"][:-1] + [script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    served = json.loads(record.read_text())
    cmd = build_command(served)
    # the served knobs' command, then the extraction flags, then the operator's own extra flags
    assert "--speculative-config" in cmd and cmd[-2:] == ["--seed", "3"]
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "extract_hidden_states"  # not MTP: the one slot is taken
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [64]  # the last layer's output
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == "/mtp/hs-raw"
    assert cmd.count("--speculative-config") == 1
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[2:])
    # vLLM refuses a context longer than the batch budget when chunked prefill is off
    assert args.enable_chunked_prefill is False and args.enable_prefix_caching is False
    assert args.max_num_batched_tokens == args.max_model_len == 4096


# ---- make mtp-*

FAKE_COMPOSE = """#!/bin/sh
# docker compose, as far as the mtp targets use it: records each call; fails the one whose words contain $FAIL_ON
echo "$*" >> "$COMPOSE_LOG"
case " $* " in *" $FAIL_ON "*) [ -n "$FAIL_ON" ] && exit 3;; esac
exit 0
"""


def make(target: str, tmp_path: Path, *args: str, fail_on: str = "") -> tuple[subprocess.CompletedProcess, list]:
    fake = tmp_path / "compose"
    fake.write_text(FAKE_COMPOSE)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE") and k not in ("MFLAGS", "MAKEOVERRIDES")}
    r = subprocess.run(["make", "-s", target, f"COMPOSE={fake}", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env={**env, "COMPOSE_LOG": str(log), "FAIL_ON": fail_on})
    return r, (log.read_text().splitlines() if log.exists() else [])


def test_make_mtp_collect_needs_a_prompt_file_and_a_key(tmp_path):
    r, calls = make("mtp-collect", tmp_path)
    assert r.returncode == 2 and "usage: make mtp-collect PROMPTS=" in r.stdout and calls == []
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    r, calls = make("mtp-collect", tmp_path, f"PROMPTS={prompts}", "KEY=sk-bench")
    assert r.returncode == 0, r.stderr
    (call,) = calls
    words = shlex.split(call)
    # through the gateway on the compose network, with the bench key, the host's file mounted read-only
    assert words[:4] == ["--profile", "mtp", "run", "--rm"] and f"{prompts}:/mtp/prompts.jsonl:ro" in words
    assert words[words.index("mtp-train") + 1:] == ["collect", "--url", "http://proxy:8080", "--key", "sk-bench",
                                                    "--prompts", "/mtp/prompts.jsonl", "--out", "/mtp/answers.jsonl"]


@pytest.mark.parametrize("fail_on", ["", "extract"])
def test_make_mtp_extract_gives_the_gpus_back_to_vllm_whatever_extract_did(tmp_path, fail_on):
    r, calls = make("mtp-extract", tmp_path, fail_on=fail_on)
    assert (r.returncode == 0) == (fail_on == ""), r.stderr
    assert calls[0] == "stop vllm" and calls[1] == "--profile mtp up -d --wait mtp-extract"
    assert calls[2].startswith("--profile mtp run --rm mtp-train extract --url http://mtp-extract:8000")
    assert calls[3:] == ["--profile mtp stop mtp-extract", "start vllm"]


@pytest.mark.parametrize("fail_on", ["", "train"])
def test_make_mtp_train_says_how_to_serve_the_head_or_restarts_vllm(tmp_path, fail_on):
    r, calls = make("mtp-train", tmp_path, "TRAIN_ARGS=--steps 600", fail_on=fail_on)
    assert calls[0] == "stop vllm"
    assert calls[1] == ("--profile mtp run --rm mtp-train train --hidden /mtp/hidden "
                        "--out /models/mtp-head/mtp.safetensors --steps 600")
    if fail_on:
        assert r.returncode != 0 and calls[2:] == ["start vllm"]  # nothing new to serve: the old server back
    else:
        assert r.returncode == 0 and calls[2:] == [] and "BONSAI_MTP_REPO=/models/mtp-head" in r.stdout
