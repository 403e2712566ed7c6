"""`make demo`: the whole stack on a machine without GPUs — vLLM-CPU with this plugin, the gateway, Open WebUI.

    make demo        # vLLM-CPU + gateway (demo keys printed) + Open WebUI on 127.0.0.1:3000
    make demo-api    # vLLM-CPU alone, on 127.0.0.1:8000: quick API tries

With the UI it serves the *scripted* tiny model (testing.tiny.write_scripted): a tiny multimodal model that
answers every message with the same short reply, a reasoning part and an answer, so the page shows what the
real model's answers look like (streaming, the folded "Thought for ..." section, image attachments) in
seconds. `--random` serves the random tiny ternary model through the plugin's maths instead (nonsense words).
The gateway and Open WebUI run as compose runs them (proxy/run-local.sh; bonsai_vllm.testing.devwebui). Ctrl-C stops
everything; the model, keys and the UI's data stay in --cache for the next run.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import requests

from bonsai_vllm.testing.devserver import ServerFailed, VllmServer, free_port

REPO = Path(__file__).resolve().parents[3]
SERVE_FLAGS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice",
               "--scheduling-policy", "priority"]
NAME = "bonsai-tiny"


def build_model(cache: Path, kind: str) -> Path:
    """kind: "scripted" (multimodal, canned reply), "ternary" (random, through the plugin) or "dense"."""
    from bonsai_vllm.testing.tiny import TinyVision, write_scripted, write_tiny

    out = cache / f"tiny-{kind}"
    if (out / "config.json").exists():
        return out
    print(f">> writing the tiny {kind} model to {out}")
    if kind == "scripted":
        src = write_tiny(cache / "tiny-vision", seed=0, vision=TinyVision())
        write_scripted(src, out)
        return out
    write_tiny(out, seed=0)
    if kind == "ternary":
        import shutil

        from bonsai_vllm.checkpoint.convert import convert_to_ternary

        tmp = out.with_name(out.name + ".dense")
        out.rename(tmp)
        convert_to_ternary(tmp, out, seed=0)
        shutil.rmtree(tmp)
    return out


def demo_keys(cache: Path) -> dict[str, str]:
    """The demo's gateway keys (kept in cache/keys): the UI's (openwebui, 0) and one for API tries (agents, 5)."""
    path = cache / "keys"
    if not path.exists():
        path.write_text("# make demo's gateway keys (local only)\n"
                        f"sk-demo-ui-{secrets.token_urlsafe(18)}  openwebui  0\n"
                        f"sk-demo-agents-{secrets.token_urlsafe(18)}  agents  5\n")
    keys = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, source = line.split()[:2]
            keys[source] = key
    return keys


def start_gateway(cache: Path, upstream: str, upstream_key: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "UPSTREAMS": upstream, "PORT": str(port), "KEYS": str(cache / "keys"),
           "RUN_DIR": str(cache / "gateway"), "METRICS_PORT": "off", "UPSTREAM_API_KEY": upstream_key,
           "ACCESS_LOG": str(cache / "gateway-access.log")}
    proc = subprocess.Popen([str(REPO / "proxy" / "run-local.sh")], env=env,
                            stdout=open(cache / "gateway.log", "ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerFailed(f"the gateway exited ({proc.returncode}); see {cache / 'gateway.log'}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except requests.ConnectionError:
            time.sleep(0.1)
    proc.terminate()
    raise ServerFailed(f"the gateway did not start; see {cache / 'gateway.log'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-ui", action="store_true", help="vLLM alone (make demo-api), no gateway or UI")
    parser.add_argument("--random", action="store_true", help="serve the random tiny ternary model")
    parser.add_argument("--dense", action="store_true", help="with --random/--no-ui: the dense model, no plugin maths")
    parser.add_argument("--port", type=int, default=8000, help="vLLM's port with --no-ui (default 8000)")
    parser.add_argument("--gateway-port", type=int, default=8080, help="the gateway's port (default 8080)")
    parser.add_argument("--ui-port", type=int, default=3000, help="Open WebUI's port (default 3000)")
    parser.add_argument("--cache", type=Path, default=Path(".cache/demo"), help="model, keys and UI data")
    args = parser.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    kind = "dense" if args.dense else ("ternary" if (args.random or args.no_ui) else "scripted")
    model = build_model(args.cache, kind)
    if args.no_ui:
        return serve_api_only(model, args)

    upstream_key = secrets.token_urlsafe(24)  # vLLM's own key: only the gateway has it
    server = VllmServer(model, [*SERVE_FLAGS, "--api-key", upstream_key, "--max-model-len", "32768"],
                        served_name=NAME, port=free_port(), log_path=args.cache / "vllm.log")
    print(f">> starting vLLM-CPU (about a minute; log {server.log_path})")
    procs = []
    try:
        with server:
            keys = demo_keys(args.cache)
            procs.append(start_gateway(args.cache, server.url, upstream_key, args.gateway_port))
            gateway = f"http://127.0.0.1:{args.gateway_port}"
            from bonsai_vllm.testing.devwebui import WebUI

            print(">> starting Open WebUI (half a minute)")
            with WebUI(args.cache / "webui-data", gateway, keys["openwebui"], port=args.ui_port, model=NAME) as ui:
                print(f"\nThe stack is up, on this machine only:\n"
                      f"  Open WebUI  {ui.url}   first visit: create the admin account (kept in {args.cache})\n"
                      f"  gateway     {gateway}/v1   keys in {args.cache / 'keys'}\n\nTry the API:\n"
                      f"  curl -s {gateway}/v1/chat/completions -H 'Authorization: Bearer {keys['agents']}' \\\n"
                      f"    -H 'Content-Type: application/json' -d '{{\"model\": \"{NAME}\", \"messages\": "
                      "[{\"role\": \"user\", \"content\": \"What comes after Monday?\"}]}'\n"
                      + ("\n(The scripted tiny model gives the same reply to everything.)" if kind == "scripted" else
                         "\n(The tiny model is random: expect nonsense words.)") + "  Ctrl-C to stop.")
                while server.proc.poll() is None and ui.proc.poll() is None and procs[0].poll() is None:
                    time.sleep(1)
                print("a part of the stack exited; logs in", args.cache)
                return 1
    except ServerFailed as e:
        print(e, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopped")
        return 0
    finally:
        for p in procs:
            p.terminate()


def serve_api_only(model: Path, args) -> int:
    server = VllmServer(model, ["--scheduling-policy", "priority"], served_name=NAME, port=args.port,
                        log_path=args.cache / "vllm.log")
    print(f">> starting vLLM-CPU on port {args.port} (about a minute; log: {server.log_path})")
    try:
        with server:
            print(f"\nvLLM is serving {model} as '{NAME}' at {server.url}/v1\n\nTry:\n"
                  f"  curl -s {server.url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
                  f"    -d '{{\"model\": \"{NAME}\", \"priority\": 0, \"max_tokens\": 32, "
                  "\"messages\": [{\"role\": \"user\", \"content\": \"What comes after Monday?\"}]}'\n"
                  "\n(The tiny model is random: expect nonsense words, not answers.)  Ctrl-C to stop.")
            while server.proc and server.proc.poll() is None:
                time.sleep(1)
            print("vLLM exited; see", server.log_path)
            return 1
    except ServerFailed as e:
        print(e, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopped")
        return 0


if __name__ == "__main__":
    sys.exit(main())
