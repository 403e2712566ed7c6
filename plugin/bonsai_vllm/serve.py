"""`bonsai-serve`: start vLLM for Ternary-Bonsai-2-27B from environment knobs (the compose `vllm` service).

Report 002's `serve.sh` exposed a handful of knobs; the same ones are variables here (defaults in
`.env.example`), turned into one `vllm serve` command line. Flags that every deployment needs are always
on — the reasoning and tool parsers (report 000: forgetting them silently spoils every accuracy test),
priority scheduling with our preempting scheduler, prefix caching with xxhash at a fine match unit.

`bonsai-serve --print` prints the command instead of running it; extra arguments are passed to vLLM.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass

SCHEDULER = "bonsai_vllm.adapters.scheduler.AsyncPreemptScheduler"


@dataclass(frozen=True)
class Knob:
    env: str
    default: str
    help: str


KNOBS = [
    Knob("MODEL_DIR", "/models/bonsai", "model directory written by model-fetch"),
    Knob("SERVED_MODEL_NAME", "bonsai-27b", "model name clients ask for"),
    Knob("TP", "2", "tensor-parallel size (GPUs)"),
    Knob("MEM", "0.72", "fraction of each GPU's memory vLLM may use (lower it if the display GPU is busy)"),
    Knob("SEQS", "24", "sequences decoded at once"),
    Knob("MAX_MODEL_LEN", "131072", "longest context in tokens"),
    Knob("KV", "auto", "KV cache format: auto (bf16), fp8, k3v2 (OSCAR 3-bit K / 2-bit V; docs/kv-cache.md) or a TurboQuant format"),
    Knob("MTP", "1", "MTP draft tokens per step (0 turns speculative decoding off)"),
    Knob("MAX_BATCHED_TOKENS", "2048", "tokens per engine step"),
    Knob("PREFIX_MATCH_UNIT", "16", "prefix-cache hash granularity in tokens (report 000: 28% → 99% hits)"),
    Knob("KV_OFFLOAD_GB", "0", "CPU RAM for offloaded KV blocks in GiB (0 = off)"),
    Knob("LANGUAGE_MODEL_ONLY", "0", "1 = skip the vision tower (text only, saves memory)"),
    Knob("VLLM_EXTRA_ARGS", "", "anything else for vllm serve, as shell words"),
]


def knob(name: str, env: dict[str, str]) -> str:
    default = next(k.default for k in KNOBS if k.env == name)
    value = env.get(name, "")
    return value if value != "" else default


def build_command(env: dict[str, str]) -> list[str]:
    """The `vllm serve` argv for these settings."""
    k = lambda name: knob(name, env)  # noqa: E731
    cmd = ["vllm", "serve", k("MODEL_DIR"),
           "--served-model-name", k("SERVED_MODEL_NAME"),
           "--host", "0.0.0.0", "--port", "8000",
           "--tensor-parallel-size", k("TP"),
           "--gpu-memory-utilization", k("MEM"),
           "--max-num-seqs", k("SEQS"),
           "--max-model-len", k("MAX_MODEL_LEN"),
           "--max-num-batched-tokens", k("MAX_BATCHED_TOKENS"),
           "--scheduling-policy", "priority", "--scheduler-cls", SCHEDULER,
           "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder", "--enable-auto-tool-choice",
           "--enable-prefix-caching", "--prefix-caching-hash-algo", "xxhash",
           "--prefix-match-unit", k("PREFIX_MATCH_UNIT"),
           # bf16 Mamba/GDN state keeps the fused GDN decode kernel (report 000: fp16 fell back, 14% slower).
           "--mamba-ssm-cache-dtype", "bfloat16"]
    if k("KV") != "auto":
        cmd += ["--kv-cache-dtype", k("KV")]
    if int(k("MTP")) > 0:
        cmd += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": int(k("MTP"))})]
    if float(k("KV_OFFLOAD_GB")) > 0:
        cmd += ["--kv-offloading-backend", "native", "--kv-offloading-size", k("KV_OFFLOAD_GB")]
    if k("LANGUAGE_MODEL_ONLY") == "1":
        cmd += ["--language-model-only"]
    cmd += shlex.split(k("VLLM_EXTRA_ARGS"))
    return cmd


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        for kn in KNOBS:
            print(f"  {kn.env:<20} {kn.help} (default {kn.default!r})")
        return 0
    printing = argv[:1] == ["--print"]
    cmd = build_command(dict(os.environ)) + argv[1 if printing else 0:]
    if printing:
        print(shlex.join(cmd))
        return 0
    print("bonsai-serve:", shlex.join(cmd), flush=True)
    os.execvp(cmd[0], cmd)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
