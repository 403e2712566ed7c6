"""`bonsai-serve`: start vLLM for Ternary-Bonsai-2-27B from environment knobs (the compose `vllm` service).

Report 002's `serve.sh` (its appendix; the field reports are described in docs/field-reports.md) exposed a
handful of knobs; the same ones are variables here (defaults in
`.env.example`), turned into one `vllm serve` command line. Flags that every deployment needs are always
on — the reasoning and tool parsers (report 000 §3: forgetting them silently spoils every accuracy test),
priority scheduling with our preempting scheduler, prefix caching with xxhash at a fine match unit.

`bonsai-serve --print` prints the command instead of running it; extra arguments are passed to vLLM.

`bonsai-serve --check [--gpu-memory 12GiB]` prints the memory plan of one GPU (weights, runtime, KV pool in
tokens for the chosen format, GDN state per sequence, how many sequences of MAX_MODEL_LEN fit) from the
capacity model (kv/capacity.py) for the GPUs it finds or the size given, and exits 1 with the fixes
when vLLM would refuse to start (its pool must hold one request of MAX_MODEL_LEN). `bonsai-serve` runs the
same check before starting vLLM, so a misfit fails in a second instead of after minutes of loading
(BONSAI_SKIP_CHECK=1 skips it).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass

from bonsai_vllm import settings

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
    Knob("KV", "k3v2", "KV cache format: k3v2 (OSCAR 3-bit K / 2-bit V, as report 002 serves; docs/kv-cache.md), auto (bf16: does not fit 131072 tokens on 12 GB), fp8 or a TurboQuant format"),
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
           # bf16 Mamba/GDN state keeps the fused GDN decode kernel (report 000 §4: fp16 fell back, 14% slower).
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


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10 ** 3, "mb": 10 ** 6,
          "gb": 10 ** 9}


def parse_size(text: str) -> int:
    """'12GiB', '12227MiB', '12 GB' or a byte count -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"--gpu-memory {text!r}: give a size such as 12GiB, 12227MiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def detect_gpus() -> list[tuple[str, int]]:
    """(name, total bytes) of each visible CUDA GPU; [] without one (or without torch)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())]


def preflight(env: dict[str, str], gpu_memory: int | None = None, out=sys.stdout) -> int:
    """Print the memory plan; 0 if vLLM will start with these settings, 1 if not (with the fixes), 2 if the
    GPUs cannot be known."""
    from bonsai_vllm.kv import capacity

    k = lambda name: knob(name, env)  # noqa: E731
    tp = int(k("TP"))
    if gpu_memory is None:
        gpus = detect_gpus()
        if not gpus:
            print("bonsai-serve --check: no CUDA GPU visible here; give the card's size: --gpu-memory 12GiB",
                  file=out)
            return 2
        if len(gpus) < tp:
            print(f"bonsai-serve --check: TP={tp} needs {tp} GPUs, {len(gpus)} visible "
                  f"({', '.join(n for n, _ in gpus)}). Fix: TP={len(gpus)} in .env, or check that Docker sees "
                  "every GPU (make doctor).", file=out)
            return 1
        name, gpu_memory = min(gpus[:tp], key=lambda g: g[1])  # the smallest card bounds every rank
        print(f"GPUs: {', '.join(f'{n} ({b / capacity.GIB:.2f} GiB)' for n, b in gpus)}", file=out)
    p = capacity.plan(gpu_memory, gpus=tp, tp=tp, utilization=float(k("MEM")), kv=k("KV"),
                      max_model_len=int(k("MAX_MODEL_LEN")), seqs=int(k("SEQS")), num_spec=int(k("MTP")),
                      ssd_embeddings=settings.get("BONSAI_SSD_EMBED_DIR", env) is not None)
    print(f"bonsai-serve --check: KV={k('KV')} MAX_MODEL_LEN={k('MAX_MODEL_LEN')} SEQS={k('SEQS')} "
          f"MTP={k('MTP')} TP={tp}", file=out)
    for line in capacity.describe(p):
        print("  " + line, file=out)
    if p.pool is None:
        print("  (not checked: vLLM decides at start-up)", file=out)
        return 0
    if p.fits:
        print("fits: vLLM will start with these settings.", file=out)
        return 0
    need = p.pool["blocks_per_request"] * p.pool["page_bytes"] * capacity.ATTN_LAYERS
    print(f"does not fit: one request of MAX_MODEL_LEN={p.max_model_len} needs "
          f"{need / capacity.GIB:.2f} GiB of KV cache per GPU, {max(p.kv_bytes, 0) / capacity.GIB:.2f} GiB "
          "are left; vLLM would stop at start-up (check_enough_kv_cache_memory). Fix, in .env, one of:", file=out)
    for f in capacity.fixes(p):
        print(f"  - {f}", file=out)
    return 1


def usage() -> str:
    """`bonsai-serve --help`: what it does, its knobs, and the plugin's BONSAI_* switches (bonsai_vllm.settings)."""
    lines = [__doc__.rstrip(), "", "Knobs (environment; .env.example explains each, empty = the default):"]
    lines += [f"  {kn.env:<20} {kn.help} (default {kn.default!r})" for kn in KNOBS]
    lines += ["", "Plugin switches (environment of every vLLM process; docs/settings.md). Unset or empty = the default;",
              "a bool is 1/true/yes/on or 0/false/no/off; bonsai-serve refuses a value that does not parse:",
              settings.describe()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    env = dict(os.environ)
    errors, warnings = settings.check(env)  # a typo fails here, in a second, not in a worker minutes later
    for w in warnings:
        print(f"bonsai-serve: warning: {w}", file=sys.stderr)
    if errors:
        for e in errors:
            print(f"bonsai-serve: {e}", file=sys.stderr)
        print("bonsai-serve: not starting vLLM; docs/settings.md says what each setting accepts", file=sys.stderr)
        return 2
    if argv[:1] == ["--check"]:
        rest = argv[1:]
        size = None
        if rest[:1] == ["--gpu-memory"] and len(rest) >= 2:
            size, rest = parse_size(rest[1]), rest[2:]
        if rest:
            print(f"bonsai-serve --check: unexpected arguments {rest}; usage: bonsai-serve --check "
                  "[--gpu-memory 12GiB]", file=sys.stderr)
            return 2
        return preflight(env, size)
    printing = argv[:1] == ["--print"]
    cmd = build_command(env) + argv[1 if printing else 0:]
    if printing:
        print(shlex.join(cmd))
        return 0
    if not settings.get("BONSAI_SKIP_CHECK", env):
        rc = preflight(env)
        if rc == 1:
            print("bonsai-serve: not starting vLLM (BONSAI_SKIP_CHECK=1 starts it anyway)", file=sys.stderr)
            return 1
    print("bonsai-serve:", shlex.join(cmd), flush=True)
    os.execvp(cmd[0], cmd)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
