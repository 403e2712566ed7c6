"""Every `BONSAI_*` switch of the plugin in one place: its type, default, help and reader, parsed one way.

Scope: the switches read inside this package (`bonsai_vllm`, `bonsai-serve` included), i.e. in the vLLM
service's processes and by the dev tools under `testing/`. They are declared in `SETTINGS` below; readers
call `get("BONSAI_AR_INT8")` and never look at `os.environ` for a `BONSAI_*` name themselves.
Not in scope, but listed in `ELSEWHERE` so that docs/settings.md names every `BONSAI_*` variable of the
project: bonsai-fetch's own variables (model-fetch/bonsai_fetch/cli.py keeps them, each beside its flag,
because a flag overrides them; docs/model-fetch.md explains them), compose's image tag, and the tests' own
switches. The host scripts in wsl/ read no `BONSAI_*` variable.

One rule for every value:
- unset, empty or only spaces: the default;
- bool: 1/true/yes/on is on, 0/false/no/off is off (any case);
- int / float: a number (an int's minimum, where it has one, is checked);
- path: a filesystem path (`~` expanded); the default of most is None, meaning "off";
- choice: one of the listed words; str: the text as given;
- anything else raises ValueError naming the variable, the value and what it accepts.

`get(name)` reads the process environment once per name and caches the result (every vLLM process reads its
switches at start-up; a later change to os.environ is not seen: `clear_cache()` forgets). `get(name, env)`
parses `env` instead, bypassing the cache (the tests, and readers that take an `environ` mapping).

`python -m bonsai_vllm.settings` prints the table; `--markdown` prints docs/settings.md (a test keeps that file
equal to this output). `bonsai-serve --help` lists the same table. Standard library only: no vLLM, no torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

TYPES = ("bool", "int", "float", "str", "path", "choice")
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    name: str
    type: str  # one of TYPES
    default: Any  # the parsed value used when the variable is unset or empty (None: off / computed by the reader)
    help: str
    reader: str  # where it is read, relative to plugin/bonsai_vllm
    choices: tuple[str, ...] = ()  # type "choice" only
    minimum: int | float | None = None  # int / float only
    compose: str | None = None  # the .env variable compose.yaml passes to the vllm service under this name
    shown_default: str | None = None  # how the docs show a default the reader computes (default None)

    def __post_init__(self):
        if self.type not in TYPES:
            raise ValueError(f"{self.name}: unknown type {self.type!r}, expected one of {', '.join(TYPES)}")
        if (self.type == "choice") != bool(self.choices):
            raise ValueError(f"{self.name}: choices go with type 'choice', and only with it")

    def accepted(self) -> str:
        """What the variable accepts, in words (for errors and the docs)."""
        if self.type == "bool":
            return f"{'/'.join(TRUE)} or {'/'.join(FALSE)}"
        if self.type == "choice":
            return "one of " + ", ".join(self.choices)
        if self.type in ("int", "float"):
            what = "a whole number" if self.type == "int" else "a number"
            return what + (f" of at least {self.minimum}" if self.minimum is not None else "")
        return "a path" if self.type == "path" else "any text"

    def parse(self, raw: str | None) -> Any:
        """The value of `raw` (the variable's text; None when unset) under the one rule (module docstring)."""
        text = "" if raw is None else raw.strip()
        if not text:
            return self.default
        if self.type == "str":
            return text
        if self.type == "path":
            return Path(text).expanduser()
        if self.type == "bool":
            word = text.lower()
            if word in TRUE or word in FALSE:
                return word in TRUE
        elif self.type == "choice":
            if text in self.choices:
                return text
        else:
            try:
                value = int(text) if self.type == "int" else float(text)
            except ValueError:
                value = None
            if value is not None and (self.minimum is None or value >= self.minimum):
                return value
        raise ValueError(f"{self.name}={raw!r}: expected {self.accepted()} "
                         f"(empty or unset: the default, {self.default_text()})")

    def kind(self) -> str:
        """The type as the docs show it: `int >= 0`, `choice: sample, full, off`."""
        if self.type == "choice":
            return "choice: " + ", ".join(self.choices)
        return self.type + (f" >= {self.minimum}" if self.minimum is not None else "")

    def default_text(self) -> str:
        if self.shown_default is not None:
            return self.shown_default
        if self.default is None:
            return "unset"
        if self.type == "bool":
            return "1" if self.default else "0"
        return str(self.default)


SETTINGS: tuple[Setting, ...] = (
    # ---- the int8 all-reduce (comm/, adapters/allreduce.py)
    Setting("BONSAI_AR_INT8", "bool", True,
            "int8 all-reduce between the tensor-parallel ranks for prefill-sized payloads (report 002's "
            "PRISM_AR_INT8=1); 0 keeps vLLM's own all-reduce for every payload",
            "adapters/allreduce.py", compose="AR_INT8"),
    Setting("BONSAI_AR_INT8_MIN_TOKENS", "int", 128,
            "rows from which an all-reduce payload counts as prefill-sized and goes int8; smaller ones keep "
            "vLLM's all-reduce",
            "adapters/allreduce.py", minimum=0),
    # ---- the scheduler (scheduling.py, adapters/scheduler.py; docs/scheduling.md)
    Setting("BONSAI_PRIORITY_PREEMPT", "bool", True,
            "a waiting request of better priority preempts the worst running ones; 0 restores stock vLLM "
            "(no preemption for waiting requests)",
            "scheduling.py (PolicyConfig.from_env)", compose="PREEMPT"),
    Setting("BONSAI_PREFILL_BUDGET_DECODING", "int", 256,
            "prefill tokens per step, all requests together, while anyone decodes (0: vLLM's own budget)",
            "scheduling.py (PolicyConfig.from_env)", minimum=0, compose="PREFILL_BUDGET"),
    Setting("BONSAI_PREFILL_CHUNK_IDLE", "int", 512,
            "prefill tokens per request per step when nobody decodes (0: vLLM's own budget)",
            "scheduling.py (PolicyConfig.from_env)", minimum=0),
    Setting("BONSAI_PREEMPT_COOLDOWN", "int", 16,
            "steps during which a just-preempted request cannot trigger a preemption itself",
            "scheduling.py (PolicyConfig.from_env)", minimum=0),
    Setting("BONSAI_SCHED_TRACE", "path", None,
            "a file the scheduler appends one JSON line per step to (wall-clock time, tokens, prefill tokens, "
            "decoding requests, preemptions); unset: no trace",
            "adapters/scheduler.py"),
    Setting("BONSAI_HTTP_TRACE", "path", None,
            "a file the API server's request clock appends one JSON line per HTTP request event to (arrived, "
            "answered; served with --middleware bonsai_vllm.testing.http_clock.HttpClock, as the scheduler tests "
            "do); unset: no clock",
            "testing/http_clock.py"),
    # ---- the SSD embedding (embeddings.py, adapters/embedding.py; docs/ssd-embeddings.md)
    Setting("BONSAI_SSD_EMBED_DIR", "path", None,
            "the embedding export to serve cold rows from (embed_tokens.bin + .json, which bonsai-fetch writes "
            "to embed_ssd/ in the model directory); unset: off, the whole table stays on the GPUs. compose "
            "sets it to /models/bonsai/embed_ssd unless SSD_EMBED_DIR says otherwise (empty: off)",
            "adapters/embedding.py, serve.py (--check)", compose="SSD_EMBED_DIR"),
    Setting("BONSAI_SSD_EMBED_HOT", "int", None,
            "embedding rows kept on the GPU: the first N of the export's hot_ids (most frequent first); more "
            "than the export ranks is an error",
            "adapters/embedding.py", minimum=0, shown_default="32000, or every id the export ranks if fewer"),
    Setting("BONSAI_SSD_EMBED_VERIFY", "choice", "sample",
            "at load, compare the export's cold rows with the checkpoint's, bit for bit: sample (a spread of "
            "rows per shard), full (every cold row) or off",
            "adapters/embedding.py", choices=("sample", "full", "off")),
    # ---- the ternary linear layers (ternary/kernels/; docs/benchmarks.md)
    Setting("BONSAI_DP4A_GEMV", "bool", True,
            "Decode steps of one row (one user, MTP off) through the dp4a GEMV (int8 activations + residual, "
            "four weights per instruction; on the H200 1.09-1.76x the fma GEMV) instead of the fma GEMV. 0: the "
            "fma GEMV. make gpu-check passed it at every real shape on the H200 (docs/benchmarks.md, issue 19).",
            "ternary/kernels/linear.py"),
    Setting("BONSAI_STREAM_GEMV", "bool", True,
            "Decode steps of one or two rows (one user, MTP off or on) on CUDA through the CUDA C GEMV that streams "
            "the codes past activations held in registers (ternary/kernels/stream_gemv.cu, compiled by NVRTC at "
            "load; on the H200 1.23-1.53x the routes it replaced, served). 0: the dp4a GEMV at one row, the mma "
            "kernel at two. make gpu-check passed it at every real shape on the H200 (issue 19).",
            "ternary/kernels/linear.py"),
    Setting("BONSAI_MMA_GEMM", "bool", True,
            "Decode batches of 2 to 64 rows (one user with MTP; several users; MTP verify rows) on CUDA "
            "through the int8 tensor-core kernel that decodes the codes in registers behind a pipeline of "
            "cp.async or, on sm_90, tensor copies (ternary/kernels/mma.cu, compiled by NVRTC at load; on the H200 "
            "1.0-2.4x the routes it replaced). 0: the GEMVs it replaced (issue 19).",
            "ternary/kernels/linear.py"),
    Setting("BONSAI_MMA_RULE", "choice", "auto",
            "Which tables pick the mma kernel's configuration per row count (ternary/kernels/mma.py): auto (the "
            "GPU's own: sm120 on the RTX 50 series, sm90 elsewhere), sm90 (from the H200's sweeps) or sm120 (from "
            "H200 sweeps at an RTX 50 card's occupancy, on 48 SMs up to 24 rows: 1.0-1.65x faster there than "
            "sm90's at 8-48 rows, measured that way; issue 19). Only the speed changes: the error bounds are the "
            "same.",
            "ternary/kernels/linear.py", choices=("auto", "sm90", "sm120")),
    Setting("BONSAI_MMA_TMA", "bool", True,
            "Let the mma kernel take its codes and activations by tensor copies (TMA: one bulk copy per operand "
            "and stage) where its rule does: 1.03-1.39x faster served on the H200, and on the RTX 5070's emulation "
            "1.01-1.36x with the constant start, which no RTX 50 card has run yet. 0: the same instances with "
            "per-thread cp.async copies (issue 19).",
            "ternary/kernels/linear.py"),
    Setting("BONSAI_CUDA_ROTATION", "bool", True,
            "Decode rows of 1 to 64 on CUDA (sm_90 and later) that reach a layer unrotated: the Hadamard rotation "
            "and the int8 prep of the dp4a, streaming and mma kernels in one CUDA C kernel, butterflies in registers "
            "and warp shuffles (ternary/kernels/rotate_prep.cu, compiled by NVRTC at load; on the H200 2.2 µs "
            "against 3.0-3.4 alone), instead of the Triton kernel's tensor-core products (hadamard.rotate_dp4a). "
            "The same bytes up to the rotation's float32 rounding; make gpu-check passed it bit for bit against its "
            "reference and at every layer (issue 19). Ahead of the streaming GEMV, Triton's kernel still serves where "
            "the CUDA C one would run more than 8 CTAs (two rows of K = 5120, four of 3072): beside that GEMV the CUDA "
            "C kernel slows down, Triton's does not (linear.cuda_prep_serves).",
            "ternary/kernels/linear.py"),
    Setting("BONSAI_CODES_GEMM", "bool", True,
            "Prefill chunks of 65 to 512 rows with the int8 weights W8 not kept (12 GB cards) through the int8 "
            "GEMM that decodes the 2-bit codes into W8 inside its K loop (int8mm.codes_gemm) instead of "
            "expanding W8 into a scratch buffer on every call: on the H200 1.4-2.4x faster at 128 rows, "
            "1.2-1.9x at 256, level at 512 (make bench-prefill); make gpu-check passed it at the real shapes. "
            "0: expand per call at every prefill size (issue 19). No effect where W8 is kept.",
            "ternary/kernels/linear.py"),
    Setting("BONSAI_FUSED_NORM", "bool", True,
            "Qwen3.5 decoder layers: the RMSNorm (with its residual add) fused into the rotation + prep of the "
            "decode rows of the ternary layer it feeds (gate_up_proj; qkv_proj on full-attention layers), one CUDA C "
            "kernel (rotate_prep.norm_rotate_prep) instead of vLLM's norm and then ours: one kernel boundary less "
            "per pair (80 pairs per rank on the 27B). On an H100 the pair took 1.01-1.46x less time than vLLM's norm "
            "and then the layer at 1-512 rows (gate_up 1.24x, qkv 1.27x at one row; make bench-norm), make "
            "gpu-check bit for bit against its reference. Needs BONSAI_CUDA_ROTATION; elsewhere the same norm in "
            "torch, then the layer. 0: vLLM's norm, then the layer (issue 19).",
            "adapters/fused_norm.py"),
    # ---- the K3V2 KV cache (kv/, adapters/k3v2_attention.py; docs/kv-cache.md)
    Setting("BONSAI_K3V2_PREFILL_KERNEL", "bool", True,
            "K3V2 prefill rows on CUDA through the Triton decode kernel; 0: the chunked torch route",
            "adapters/k3v2_attention.py"),
    Setting("BONSAI_KV_ROTATION", "path", None,
            "K3V2 only: a calibrated rotation file written by bonsai-kv-calibrate; unset: the data-free "
            "Hadamard rotation. A missing file stops start-up",
            "adapters/k3v2_attention.py", compose="KV_ROTATION"),
    Setting("BONSAI_KV_CAPTURE", "path", None,
            "K3V2 only, for one calibration run: a writable directory where every full-attention layer "
            "records post-RoPE q/k/v samples for bonsai-kv-calibrate; unset: no recording",
            "adapters/k3v2_attention.py", compose="KV_CAPTURE"),
    Setting("BONSAI_KV_CAPTURE_TOKENS", "int", 4096,
            "tokens of q/k/v each layer records with BONSAI_KV_CAPTURE",
            "adapters/k3v2_attention.py", minimum=1),
    # ---- bonsai-serve (serve.py)
    Setting("BONSAI_SKIP_CHECK", "bool", False,
            "1: bonsai-serve starts vLLM even when its memory check says the settings do not fit",
            "serve.py"),
    # ---- dev tools (testing/)
    Setting("BONSAI_WEBUI_VENV", "path", None,
            "the Open WebUI environment the web UI tests and make demo run (make webui-env creates it)",
            "testing/devwebui.py", shown_default=".webui-venv in the repository"),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


@dataclass(frozen=True)
class Elsewhere:
    """A `BONSAI_*` variable read outside this package: documented here, parsed by its reader."""

    name: str
    reader: str
    help: str


_FETCH = "bonsai-fetch"
ELSEWHERE: tuple[Elsewhere, ...] = (
    Elsewhere("BONSAI_MODEL_DIR", _FETCH, "the model directory to write (--out); empty: MODEL_DIR, else /models/bonsai"),
    Elsewhere("BONSAI_MODEL_REPO", _FETCH, "the vLLM-format prism_ternary checkpoint (--model-repo)"),
    Elsewhere("BONSAI_MODEL_REVISION", _FETCH, "its revision (--model-revision)"),
    Elsewhere("BONSAI_SOURCE", _FETCH, "auto, vllm or official: where the weights come from (--source)"),
    Elsewhere("BONSAI_OFFICIAL_REPO", _FETCH, "PrismML's MLX 2-bit pack (--official-repo)"),
    Elsewhere("BONSAI_OFFICIAL_REVISION", _FETCH, "its revision (--official-revision)"),
    Elsewhere("BONSAI_VISION_REPO", _FETCH, "where the vision tower comes from, or off (--vision-repo)"),
    Elsewhere("BONSAI_VISION_REVISION", _FETCH, "its revision (--vision-revision)"),
    Elsewhere("BONSAI_VISION_CHECK", _FETCH, "refuse a tower of another base model (--vision-check)"),
    Elsewhere("BONSAI_MTP_REPO", _FETCH, "a replacement MTP head: a Hub repo or a local folder, or off (--mtp-repo)"),
    Elsewhere("BONSAI_MTP_FILE", _FETCH, "the safetensors file in it (--mtp-file)"),
    Elsewhere("BONSAI_MTP_REVISION", _FETCH, "its revision (--mtp-revision)"),
    Elsewhere("BONSAI_EMBED_EXPORT", _FETCH, "export the embedding for SSD lookup (--no-embed-export turns it off)"),
    Elsewhere("BONSAI_EMBED_HOT_VOCAB", _FETCH, "rows the export ranks as hot (--hot-vocab)"),
    Elsewhere("BONSAI_EMBED_TOKEN_COUNTS", _FETCH, "a token-count file that ranks them (--token-counts)"),
    Elsewhere("BONSAI_FETCH_CACHE", _FETCH, "the download store (--cache-dir)"),
    Elsewhere("BONSAI_FETCH_RETRIES", _FETCH, "network retries (--retries)"),
    Elsewhere("BONSAI_FETCH_FREE_BYTES", _FETCH, "tests only: pretend this much disk is free"),
    Elsewhere("BONSAI_IMAGE_TAG", "compose.yaml", "the tag of the bonsai-vllm and bonsai-gateway images (default local)"),
    Elsewhere("BONSAI_TEST_SSD_TP2", "tests/test_ssd_embedding_served.py",
              "1 adds the TP=2 SSD-embedding comparison (two more servers)"),
    Elsewhere("BONSAI_GATEWAY_ROOT", "tests/proxy/gateway_harness.py",
              "run the gateway tests on the filesystem of the built gateway image (tests/images sets it)"),
)

_cache: dict[str, Any] = {}


def setting(name: str) -> Setting:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared setting: add it to SETTINGS in bonsai_vllm/settings.py") from None


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of `name`: from `environ` when given (not cached), else from the process environment,
    read once per process."""
    s = setting(name)
    if environ is not None:
        return s.parse(environ.get(name))
    if name not in _cache:
        _cache[name] = s.parse(os.environ.get(name))
    return _cache[name]


def clear_cache() -> None:
    """Forget the values read from the process environment (the next `get` reads it again)."""
    _cache.clear()


def check(environ: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(errors, warnings) for `environ`: a declared setting whose value does not parse is an error; a
    `BONSAI_*` name that is declared nowhere (here or in ELSEWHERE) is a warning (a typo, most likely)."""
    errors, warnings = [], []
    known = set(BY_NAME) | {e.name for e in ELSEWHERE}
    for name in sorted(environ):
        if name in BY_NAME:
            try:
                BY_NAME[name].parse(environ[name])
            except ValueError as e:
                errors.append(str(e))
        elif name.startswith("BONSAI_") and name not in known:
            warnings.append(f"{name} is set but no part of Bonsai reads it (docs/settings.md lists the names)")
    return errors, warnings


def describe(width: int = 100) -> str:
    """The settings as plain text (bonsai-serve --help, `python -m bonsai_vllm.settings`)."""
    lines = []
    for s in SETTINGS:
        head = f"  {s.name} ({s.kind()}, default {s.default_text()}"
        head += f"; .env: {s.compose})" if s.compose else ")"
        lines.append(head)
        lines += textwrap.wrap(s.help, width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/settings.md."""
    out = [
        "# Settings: every `BONSAI_*` variable",
        "",
        "<!-- Generated by `python -m bonsai_vllm.settings --markdown` from plugin/bonsai_vllm/settings.py; do not",
        "     edit by hand (tests/core/test_settings.py fails when this file differs from that output). -->",
        "",
        "The plugin's switches, read from the environment of the vLLM service's processes (and of `bonsai-serve`,",
        "which checks them all before starting vLLM and lists them in `bonsai-serve --help`). One rule for all:",
        "unset or empty means the default; a boolean is on for `1`/`true`/`yes`/`on` and off for",
        "`0`/`false`/`no`/`off`; any other value stops start-up with an error naming the variable, the value and",
        "what it accepts. Each process reads a switch once, at start-up.",
        "",
        "compose.yaml passes the ones with an `.env` name to the `vllm` service from that `.env` variable",
        "(`.env.example` explains each; under compose, an unset `SSD_EMBED_DIR` means the export model-fetch",
        "writes, so the SSD embedding is on). Set the others in the service's `environment:` (a",
        "`compose.override.yaml`) or in the shell that runs `bonsai-serve`. \"read by\" is relative to",
        "`plugin/bonsai_vllm/`.",
        "",
        "| variable | type | default | `.env` | read by | meaning |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in SETTINGS:
        kind = "choice: " + ", ".join(f"`{c}`" for c in s.choices) if s.type == "choice" else s.kind()
        compose = f"`{s.compose}`" if s.compose else "—"
        out.append(f"| `{s.name}` | {kind} | {_cell(s.default_text())} | {compose} | {_cell(s.reader)} | {_cell(s.help)} |")
    out += [
        "",
        "## Read elsewhere",
        "",
        "These are read outside the plugin, each by its own component, and parsed there; bonsai-fetch's also have",
        "a flag, which wins over the variable (`bonsai-fetch --help`; the details in [model-fetch.md](model-fetch.md)).",
        "",
        "| variable | read by | meaning |",
        "| --- | --- | --- |",
    ]
    out += [f"| `{e.name}` | {_cell(e.reader)} | {_cell(e.help)} |" for e in ELSEWHERE]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bonsai_vllm.settings",
                                description="Every BONSAI_* switch of the plugin: type, default, meaning.")
    p.add_argument("--markdown", action="store_true", help="print docs/settings.md (a markdown table)")
    args = p.parse_args(argv)
    print(markdown() if args.markdown else describe(), end="" if args.markdown else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
