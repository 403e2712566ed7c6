"""`make bench-scale-out`: one model server against two behind the gateway, the same load, side by side.

Two vLLM-CPU servers serve the tiny model through our plugin, each pinned to its own core (as each PC has its
own GPUs); a gateway (proxy/run-local.sh) names one of them, another names both (UPSTREAMS). The same load
goes through each gateway in turn: CONVERSATIONS agents, each a conversation of TURNS requests of
MAX_TOKENS tokens (ignore_eos), all at once. Printed: output tokens/s and wall time each way, their ratio,
and how the conversations spread over the servers. On this 2-core machine the ratio is the figure, not the
absolute tokens/s (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "proxy"))

from gateway_harness import Gateway, auth, keys_text  # noqa: E402

from bonsai_vllm.testing.devserver import VllmServer  # noqa: E402
from bonsai_vllm.testing.tiny import write_tiny  # noqa: E402

UPSTREAM_KEY = "bench-scale-out-upstream-key"


def conversation(gw: Gateway, c: int, turns: int, max_tokens: int) -> tuple[int, list[str]]:
    """One agent's conversation, turn after turn: (output tokens, the server of each turn)."""
    messages = [{"role": "system", "content": "You count things."},
                {"role": "user", "content": f"Conversation {c}: count the animals."}]
    tokens, servers = 0, []
    for t in range(turns):
        r = requests.post(gw.url + "/v1/chat/completions", headers=auth("agent"), timeout=600, json={
            "model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True})
        r.raise_for_status()
        out = r.json()
        tokens += out["usage"]["completion_tokens"]
        servers.append(gw.log_entry(r.headers["X-Request-Id"])["upstream"].split(",")[-1].strip())
        messages += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"And now turn {t + 2}?"}]
    return tokens, servers


def run_load(gw: Gateway, conversations: int, turns: int, max_tokens: int) -> dict:
    t0 = time.monotonic()
    with ThreadPoolExecutor(conversations) as pool:
        results = list(pool.map(lambda c: conversation(gw, c, turns, max_tokens), range(conversations)))
    wall = time.monotonic() - t0
    tokens = sum(t for t, _ in results)
    homes = [set(s) for _, s in results]
    per_server: dict[str, int] = {}
    for h in homes:
        for s in h:
            per_server[s] = per_server.get(s, 0) + 1
    return {"wall": wall, "tokens": tokens, "tok_s": tokens / wall, "moved": sum(len(h) > 1 for h in homes),
            "per_server": per_server}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = write_tiny(tmp / "tiny", seed=0)
        servers = [VllmServer(model, ["--api-key", UPSTREAM_KEY], env={"VLLM_CPU_OMP_THREADS_BIND": str(core)})
                   for core in (0, 1)]
        for s in servers:
            s.launch()
        try:
            for s in servers:
                s.wait_ready()
            keys = tmp / "keys"
            keys.write_text(keys_text(["agent"]))
            env = {"UPSTREAM_API_KEY": UPSTREAM_KEY}
            results = {}
            for name, upstreams in (("one server", servers[0].url), ("two servers", f"{servers[0].url},{servers[1].url}")):
                gw = Gateway(tmp / name.replace(" ", "-"), upstreams, keys, env).start()
                try:
                    conversation(gw, 99, 1, 8)  # warm-up: first requests compile and allocate
                    results[name] = run_load(gw, args.conversations, args.turns, args.max_tokens)
                finally:
                    gw.stop()
        finally:
            for s in servers:
                s.stop()
    one, two = results["one server"], results["two servers"]
    print(f"\n{args.conversations} conversations × {args.turns} turns × {args.max_tokens} tokens, all at once, "
          "through the gateway (tiny model, vLLM-CPU, one core per server)\n")
    print("| servers | output tok/s | wall (s) | conversations per server | conversations that moved |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        spread = " / ".join(str(n) for n in sorted(r["per_server"].values(), reverse=True))
        print(f"| {name} | {r['tok_s']:.1f} | {r['wall']:.1f} | {spread} | {r['moved']} |")
    print(f"\ntwo servers / one: {two['tok_s'] / one['tok_s']:.2f}× the throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
