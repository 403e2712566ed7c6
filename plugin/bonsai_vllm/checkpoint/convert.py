"""`bonsai-convert`: dense Hugging Face Qwen3.5 checkpoint <-> vLLM-format `prism_ternary` checkpoint.

To ternary (default): HF module weights are fused into vLLM's names by concatenating rows in this order
    self_attn.{q_proj, k_proj, v_proj}      -> self_attn.qkv_proj
    mlp.{gate_proj, up_proj}                -> mlp.gate_up_proj
    linear_attn.{in_proj_qkv, in_proj_z}    -> linear_attn.in_proj_qkvz
and self_attn.o_proj, mlp.down_proj, linear_attn.out_proj and the top-level lm_head keep their names.
Each becomes `<prefix>.weight` int32 [out, in/16] + `<prefix>.scales` fp16 [out, in/128] (ternary/quantize.py);
everything else (embed_tokens, in_proj_a/b, conv1d, A_log, dt_bias, norms, mtp.*, model.visual.*) is
copied unchanged. One random ±1 sign vector per distinct input width goes into config.json's
quantization_config.

To dense (`--to-dense`): the reverse, writing the effective weights W'·H·diag(s) in bf16 under HF names,
split back with the sizes in config.json; quantization_config is removed. Converting a model there and
back gives a dense checkpoint that computes exactly what the ternary one does (up to bf16 rounding).

Both directions write into a temporary directory beside OUT and rename it into place at the end, so OUT
is never half-written.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bonsai_vllm.checkpoint.io import (
    DEFAULT_MAX_SHARD_BYTES,
    ShardWriter,
    SourceCheckpoint,
    atomic_directory,
    copy_side_files,
    parse_size,
    read_config,
    run_cli,
    write_config,
)
from bonsai_vllm.ternary.format import QUANT_METHOD, PrismTernaryConfig, check_module_tensors, encode_signs
from bonsai_vllm.ternary.quantize import dense_from_ternary, quantize_dense

GROUP_SIZE = 128
HADAMARD_BLOCK = 1024

# (parent module, fused vLLM name) -> HF part names, in the row order of the fused weight.
FUSIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
    ("mlp", "gate_up_proj"): ("gate_proj", "up_proj"),
    ("linear_attn", "in_proj_qkvz"): ("in_proj_qkv", "in_proj_z"),
}
# (parent module, name) of ternary modules that keep their HF name.
UNFUSED: frozenset[tuple[str, str]] = frozenset(
    {("self_attn", "o_proj"), ("mlp", "down_proj"), ("linear_attn", "out_proj")})
_PART_TO_FUSED = {(parent, part): fused for (parent, fused), parts in FUSIONS.items() for part in parts}


# --------------------------------------------------------------------------------------------- naming


def _language_prefix(prefix: str) -> bool:
    """True for modules of the language model proper: not the MTP drafter, not the vision tower."""
    parts = prefix.split(".")
    return "mtp" not in parts and "visual" not in parts


def ternary_target(prefix: str) -> tuple[str, int, int] | None:
    """For an HF module prefix: (vLLM prefix it goes into, its part index, number of parts); None if dense."""
    if not _language_prefix(prefix):
        return None
    if prefix == "lm_head":
        return prefix, 0, 1
    head, _, name = prefix.rpartition(".")
    parent = head.rpartition(".")[2]
    if (parent, name) in _PART_TO_FUSED:
        fused = _PART_TO_FUSED[(parent, name)]
        parts = FUSIONS[(parent, fused)]
        return f"{head}.{fused}", parts.index(name), len(parts)
    if (parent, name) in UNFUSED:
        return prefix, 0, 1
    return None


def _split_key(key: str) -> tuple[str, str]:
    prefix, _, leaf = key.rpartition(".")
    return prefix, leaf


def text_config(config: dict) -> dict:
    """The language-model part of config.json (`text_config` of a multimodal qwen3_5 config)."""
    return config.get("text_config", config)


def unfuse_sizes(fused: str, tcfg: dict) -> tuple[tuple[str, int], ...] | None:
    """HF (part name, rows) of a fused vLLM module, in row order; None for a module that is not fused."""
    if fused == "qkv_proj":
        heads, kv_heads = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
        head_dim = tcfg.get("head_dim") or tcfg["hidden_size"] // heads
        # Qwen3.5 attention has an output gate: q_proj emits query and gate, twice the query width.
        return (("q_proj", heads * head_dim * 2), ("k_proj", kv_heads * head_dim),
                ("v_proj", kv_heads * head_dim))
    if fused == "gate_up_proj":
        return (("gate_proj", tcfg["intermediate_size"]), ("up_proj", tcfg["intermediate_size"]))
    if fused == "in_proj_qkvz":
        key_dim = tcfg["linear_num_key_heads"] * tcfg["linear_key_head_dim"]
        value_dim = tcfg["linear_num_value_heads"] * tcfg["linear_value_head_dim"]
        return (("in_proj_qkv", 2 * key_dim + value_dim), ("in_proj_z", value_dim))
    return None


# ---------------------------------------------------------------------------------------- to ternary


@dataclass
class _TernaryJob:
    out_prefix: str
    parts: list[str | None]  # HF source prefixes in row order (None where a part is missing)
    in_width: int = 0


def _plan_ternary(src: SourceCheckpoint, config: dict) -> tuple[list[_TernaryJob], list[str]]:
    """Group source tensors into ternary modules (fused) and tensors copied unchanged."""
    jobs: dict[str, _TernaryJob] = {}
    copies: list[str] = []
    for key in src.keys():
        prefix, leaf = _split_key(key)
        target = ternary_target(prefix)
        if target is None or leaf not in ("weight", "bias"):
            copies.append(key)
            continue
        out_prefix, index, n_parts = target
        job = jobs.setdefault(out_prefix, _TernaryJob(out_prefix, [None] * n_parts))
        job.parts[index] = prefix

    tie = text_config(config).get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    if "lm_head" not in jobs and tie:
        # A tied LM head has no weight of its own; prism_ternary quantizes lm_head separately, so untie it.
        embed = next((k for k in src.keys() if k.endswith("embed_tokens.weight") and _language_prefix(k)), None)
        if embed is not None:
            jobs["lm_head"] = _TernaryJob("lm_head", [embed.removesuffix(".weight")])

    for job in jobs.values():
        missing = [i for i, p in enumerate(job.parts) if p is None]
        if missing:
            raise ValueError(f"{job.out_prefix}: a fused part is missing from the checkpoint (parts "
                             f"{job.parts}); the checkpoint is incomplete or not a Qwen3.5 layout")
        widths = {src.shape(f"{p}.weight")[1] for p in job.parts}
        if len(widths) != 1:
            raise ValueError(f"{job.out_prefix}: fused parts {job.parts} have different input widths {widths}")
        job.in_width = widths.pop()
        if job.in_width % HADAMARD_BLOCK:
            raise ValueError(f"{job.out_prefix}: input width {job.in_width} is not a multiple of the Hadamard "
                             f"block {HADAMARD_BLOCK}; prism_ternary cannot represent this model (every "
                             "ternary module's input width must be one)")
    return list(jobs.values()), copies


def make_signs(widths: list[int], seed: int) -> dict[int, torch.Tensor]:
    """One random ±1 float32 vector per width, drawn in ascending width order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return {w: torch.randint(0, 2, (w,), generator=gen).float() * 2 - 1 for w in sorted(set(widths))}


def convert_to_ternary(src: Path, out: Path, seed: int = 0, *, overwrite: bool = False,
                       device: str = "cpu", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       progress: bool = True) -> Path:
    """Convert a dense HF Qwen3.5 checkpoint directory into a prism_ternary one at `out`. Returns `out`."""
    src, out = Path(src), Path(out)
    config = read_config(src)
    if "quantization_config" in config:
        raise ValueError(f"{src}/config.json already has a quantization_config "
                         f"({config['quantization_config'].get('quant_method')!r}); bonsai-convert needs a "
                         "dense checkpoint (use --to-dense to go the other way)")
    # The source handles close before the finished directory is swapped in (SRC may equal OUT).
    with atomic_directory(out, overwrite) as tmp, contextlib.ExitStack() as stack:
        ckpt = SourceCheckpoint(src, stack)
        jobs, copies = _plan_ternary(ckpt, config)
        if not jobs:
            raise ValueError(f"{src}: no Qwen3.5 linear layers found to quantize (expected names like "
                             "model.layers.N.mlp.down_proj.weight)")
        signs = make_signs([j.in_width for j in jobs], seed)
        qcfg = PrismTernaryConfig(bits=2, group_size=GROUP_SIZE, hadamard_block=HADAMARD_BLOCK,
                                  signs={w: encode_signs(s) for w, s in signs.items()})
        writer = ShardWriter(tmp, max_shard_bytes)
        bar = tqdm(total=len(copies) + len(jobs), unit="tensor", desc="to prism_ternary",
                   disable=not progress)
        for key in copies:
            writer.add(key, ckpt.get(key))
            bar.update()
        for job in jobs:
            # Fuse by concatenating rows in vLLM's order: [out_total, in].
            weight = torch.cat([ckpt.get(f"{p}.weight").to(device) for p in job.parts], dim=0)
            if not weight.is_floating_point():
                raise ValueError(f"{job.out_prefix}: weight dtype {weight.dtype} is not floating point; "
                                 "the source must be a dense (bf16/fp16/fp32) checkpoint")
            packed, scales = quantize_dense(weight, signs[job.in_width].to(device), GROUP_SIZE,
                                            HADAMARD_BLOCK)
            writer.add(f"{job.out_prefix}.weight", packed)
            writer.add(f"{job.out_prefix}.scales", scales)
            biases = [f"{p}.bias" for p in job.parts if f"{p}.bias" in ckpt]
            if biases:
                if len(biases) != len(job.parts):
                    raise ValueError(f"{job.out_prefix}: only some fused parts have a bias ({biases})")
                writer.add(f"{job.out_prefix}.bias", torch.cat([ckpt.get(b) for b in biases]))
            bar.update()
        bar.close()
        writer.close()
        config = dict(config)
        config["quantization_config"] = qcfg.to_dict()
        if any(j.out_prefix == "lm_head" and j.parts[0] != "lm_head" for j in jobs):
            config["tie_word_embeddings"] = False
            if "text_config" in config:
                config["text_config"] = {**config["text_config"], "tie_word_embeddings": False}
        write_config(tmp, config)
        copy_side_files(src, tmp)
    return out


# ------------------------------------------------------------------------------------------ to dense


def convert_to_dense(src: Path, out: Path, *, overwrite: bool = False, device: str = "cpu",
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = True) -> Path:
    """Convert a prism_ternary checkpoint into a dense bf16 HF checkpoint of its effective weights."""
    src, out = Path(src), Path(out)
    config = read_config(src)
    qdict = config.get("quantization_config")
    if not qdict or qdict.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"{src}/config.json has no prism_ternary quantization_config "
                         f"(found {qdict and qdict.get('quant_method')!r}); --to-dense needs a prism_ternary "
                         "checkpoint")
    qcfg = PrismTernaryConfig.from_dict(qdict)
    tcfg = text_config(config)
    with atomic_directory(out, overwrite) as tmp, contextlib.ExitStack() as stack:
        ckpt = SourceCheckpoint(src, stack)
        keys = ckpt.keys()
        ternary = [k.removesuffix(".scales") for k in keys if k.endswith(".scales")
                   and f"{k.removesuffix('.scales')}.weight" in ckpt]
        consumed = {f"{p}.{leaf}" for p in ternary for leaf in ("weight", "scales", "bias")}
        writer = ShardWriter(tmp, max_shard_bytes)
        bar = tqdm(total=len(keys), unit="tensor", desc="to dense", disable=not progress)
        for key in keys:
            if key not in consumed:
                writer.add(key, ckpt.get(key))
                bar.update()
        for prefix in ternary:
            packed, scales = ckpt.get(f"{prefix}.weight"), ckpt.get(f"{prefix}.scales")
            out_features, in_features = packed.shape[0], packed.shape[1] * 16
            check_module_tensors(prefix, packed, scales, out_features, in_features, qcfg)
            dense = dense_from_ternary(packed.to(device), scales.to(device), qcfg.sign_vector(in_features),
                                       qcfg.group_size, qcfg.hadamard_block).to(torch.bfloat16)
            bias = ckpt.get(f"{prefix}.bias") if f"{prefix}.bias" in ckpt else None
            head, _, name = prefix.rpartition(".")
            sizes = unfuse_sizes(name, tcfg)
            if sizes is None:
                sizes = ((name, out_features),)
            if sum(rows for _, rows in sizes) != out_features:
                raise ValueError(f"{prefix}: {out_features} rows cannot be split as {dict(sizes)} "
                                 "(from config.json); the config does not match the checkpoint")
            start = 0
            for part, rows in sizes:
                part_prefix = f"{head}.{part}" if head else part
                # clone: safetensors refuses tensors that share storage with another saved tensor.
                writer.add(f"{part_prefix}.weight", dense[start:start + rows].clone())
                if bias is not None:
                    writer.add(f"{part_prefix}.bias", bias[start:start + rows].clone())
                start += rows
            bar.update(3 if bias is not None else 2)
        bar.close()
        writer.close()
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        write_config(tmp, config)
        copy_side_files(src, tmp)
    return out


# ----------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bonsai-convert",
        description="Convert a dense Hugging Face Qwen3.5 checkpoint (bf16 safetensors, single file or "
                    "sharded) into the vLLM prism_ternary format: fused qkv_proj / gate_up_proj / "
                    "in_proj_qkvz, blockwise-Hadamard-rotated ternary weights with fp16 scales per 128, "
                    "one random sign vector per input width. With --to-dense, the reverse: a prism_ternary "
                    "checkpoint becomes a dense bf16 checkpoint of its effective weights under HF names.",
        epilog="OUT is written to a temporary directory beside it and renamed into place when complete. "
               "Tokenizer, chat template and generation files are copied. Format: docs/format.md.")
    parser.add_argument("src", type=Path, metavar="SRC",
                        help="source checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("out", type=Path, metavar="OUT", help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--to-dense", action="store_true",
                        help="convert a prism_ternary checkpoint back to dense bf16 HF names")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random sign vectors (to ternary only; default 0)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (SRC may equal OUT)")
    parser.add_argument("--device", default="cpu", help="torch device for the maths, e.g. cuda (default cpu)")
    parser.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_BYTES,
                        help="largest output shard, e.g. 5GB (default) or 500MB")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    common = dict(overwrite=args.overwrite, device=args.device, max_shard_bytes=args.max_shard_size,
                  progress=not args.no_progress)
    if args.to_dense:
        out = run_cli(parser, lambda: convert_to_dense(args.src, args.out, **common))
    else:
        out = run_cli(parser, lambda: convert_to_ternary(args.src, args.out, seed=args.seed, **common))
    print(f"wrote {'dense' if args.to_dense else 'prism_ternary'} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
