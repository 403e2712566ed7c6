"""PrismML's official MLX 2-bit pack -> the vLLM `prism_ternary` checkpoint (and back, for test fixtures).

The published vLLM checkpoint is a third-party upload; PrismML's own MLX pack carries the same ternary codes
(docs/design.md §1), so the vLLM checkpoint can be rebuilt from it without any re-quantization: codes and scales
are regrouped into vLLM's fused modules, nothing is rounded.

The pack layout this reader accepts (what docs/design.md §1 records about the pack, made concrete; every
assumption is checked and a pack that differs is refused with the rule it broke, never mis-read):

- Names follow mlx-vlm: `language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`, `mtp.*`
  (mlx-lm's text-only `model.*` / `lm_head.*` are accepted too). Modules keep Hugging Face's unfused names
  (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`, `in_proj_qkv`, `in_proj_z`, ...).
- A ternary module is MLX affine 2-bit, group 128: `.weight` uint32 [out, in/16] (16 two-bit values per
  word, value i at bits 2i: the very bit layout of prism_ternary), `.scales` [out, in/128] and
  `.biases = -scales`, so MLX's `q * scale + bias` is `(q - 1) * scale`: code 0 = -1, 1 = 0, 2 = +1.
- `config.json` `quantization`: `{"group_size": 128, "bits": 2, "mode": "affine", "modules": [{"path":
  <module>, "block": 1024, "signs": <base64 of numpy.packbits(sign < 0)>}, ...]}` — the Hadamard-rotated
  modules, each with its block size and the sign vector of its input (W' = (W·diag(s))·H, as prism_ternary).
  Per-module entries keyed by path (`quantization[<path>] = {"block": ..., "signs": ...}`, mlx-lm's way of
  giving one module its own settings) are read the same way.
- Dense tensors (embeddings, norms, GDN `in_proj_a/b`, `A_log`, `dt_bias`, `mtp.*`, the vision tower) are
  stored as they are in the Hugging Face checkpoint except for MLX's channels-last convolutions:
  `conv1d.weight` [C, K, 1] (torch [C, 1, K]) and `patch_embed.proj.weight` [out, t, h, w, in] (torch
  [out, in, t, h, w]).

prism_ternary keeps one sign vector per input width, shared by every module of that width; a pack whose
modules of one width carry different signs cannot be expressed in it and is refused.

`write_mlx_pack` writes such a pack from a dense checkpoint (tests: a tiny fixture of the official pack).
Plain PyTorch: no vLLM and no MLX import.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from bonsai_vllm.checkpoint.convert import (
    GROUP_SIZE,
    HADAMARD_BLOCK,
    _split_key,
    make_signs,
    ternary_target,
    text_config,
)
from bonsai_vllm.checkpoint.io import (
    DEFAULT_MAX_SHARD_BYTES,
    ShardWriter,
    SourceCheckpoint,
    atomic_directory,
    copy_side_files,
    run_cli,
)
from bonsai_vllm.ternary.format import PrismTernaryConfig, check_module_tensors, decode_signs, encode_signs
from bonsai_vllm.ternary.quantize import quantize_dense

MLX_BITS = 2

# mlx name prefix -> checkpoint (Hugging Face / vLLM) name prefix; first match wins, so longer prefixes first.
_MLX_TO_HF = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("language_model.mtp.", "mtp."),
    ("vision_tower.", "model.visual."),
    ("mtp.", "mtp."),
    ("lm_head.", "lm_head."),
    ("model.", "model.language_model."),
)
_HF_TO_MLX = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "vision_tower."),
    ("lm_head.", "language_model.lm_head."),
    ("mtp.", "mtp."),
    ("model.", "language_model.model."),  # a text-only checkpoint's names
)


class OfficialPackError(ValueError):
    """The directory is not an official MLX pack this reader understands."""


def _map_prefix(name: str, table: tuple[tuple[str, str], ...]) -> str | None:
    # A module path ("lm_head") maps like the names under it ("lm_head.weight").
    dotted = name + "."
    for old, new in table:
        if dotted.startswith(old):
            return (new + dotted[len(old):])[:-1]
    return None


def hf_name(mlx_name: str) -> str:
    """Checkpoint name of an MLX tensor name (`language_model.model.x` -> `model.language_model.x`)."""
    mapped = _map_prefix(mlx_name, _MLX_TO_HF)
    if mapped is None:
        raise OfficialPackError(f"tensor '{mlx_name}' has no known place in the checkpoint (expected names "
                                "under language_model., vision_tower., mtp., model. or lm_head.)")
    return mapped


def mlx_name(hf: str) -> str:
    """MLX (mlx-vlm) name of a checkpoint tensor name; the inverse of `hf_name` for the multimodal layout."""
    mapped = _map_prefix(hf, _HF_TO_MLX)
    if mapped is None:
        raise OfficialPackError(f"tensor '{hf}' has no MLX name (expected model., lm_head. or mtp. names)")
    return mapped


def is_vision_name(name: str) -> bool:
    """True for a vision-tower tensor in either naming (`vision_tower.*` or `model.visual.*`)."""
    return name.startswith(("vision_tower.", "model.visual."))


def from_mlx_layout(name: str, tensor: torch.Tensor, conv_kernel: int | None) -> torch.Tensor:
    """Undo MLX's channels-last convolution layouts for one tensor (checkpoint name), else return it as is."""
    if name.endswith("patch_embed.proj.weight") and tensor.dim() == 5:
        return tensor.permute(0, 4, 1, 2, 3).contiguous()  # [out, t, h, w, in] -> [out, in, t, h, w]
    if name.endswith("conv1d.weight") and tensor.dim() == 3 and tensor.shape[2] == 1 \
            and (conv_kernel is None or tensor.shape[1] == conv_kernel):
        return tensor.transpose(1, 2).contiguous()  # [C, K, 1] -> [C, 1, K]
    return tensor


def to_mlx_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """MLX's channels-last layout of a checkpoint tensor (the inverse of `from_mlx_layout`)."""
    if name.endswith("patch_embed.proj.weight") and tensor.dim() == 5:
        return tensor.permute(0, 2, 3, 4, 1).contiguous()
    if name.endswith("conv1d.weight") and tensor.dim() == 3 and tensor.shape[1] == 1:
        return tensor.transpose(1, 2).contiguous()
    return tensor


# ---------------------------------------------------------------------------------------------- config


@dataclass
class PackQuantization:
    """The pack's `quantization` entry: group size, bits and the Hadamard-rotated modules with their signs."""

    group_size: int
    bits: int
    modules: dict[str, tuple[int, str]] = field(default_factory=dict)  # mlx module path -> (block, signs b64)

    @classmethod
    def from_config(cls, config: dict) -> PackQuantization:
        q = config.get("quantization") or config.get("quantization_config")
        if not isinstance(q, dict):
            raise OfficialPackError("config.json has no 'quantization' entry: this is not an MLX quantized pack "
                                    "(the official PrismML MLX 2-bit pack has one)")
        group, bits = q.get("group_size"), q.get("bits")
        if bits != MLX_BITS or group != GROUP_SIZE or q.get("mode", "affine") != "affine":
            raise OfficialPackError(f"quantization bits={bits}, group_size={group}, mode={q.get('mode')!r}: only "
                                    f"the 2-bit affine pack with groups of {GROUP_SIZE} holds prism_ternary codes")
        modules: dict[str, tuple[int, str]] = {}
        entries: list[dict] = list(q.get("modules") or [])
        # mlx-lm's per-module settings: quantization[<path>] = {...}; only those with signs are rotated modules.
        entries += [{"path": k, **v} for k, v in q.items() if isinstance(v, dict) and "signs" in v]
        for entry in entries:
            path, signs = entry.get("path"), entry.get("signs")
            block = entry.get("block", entry.get("hadamard_block", entry.get("block_size")))
            if not isinstance(path, str) or not isinstance(signs, str) or not isinstance(block, int):
                raise OfficialPackError(f"quantization module entry {str(entry)[:120]} needs 'path' (str), "
                                        "'block' (int) and 'signs' (base64 str)")
            if block != HADAMARD_BLOCK:
                raise OfficialPackError(f"{path}: Hadamard block {block}; prism_ternary checkpoints use "
                                        f"{HADAMARD_BLOCK}")
            modules[path] = (block, signs)
        if not modules:
            raise OfficialPackError("the pack's quantization entry lists no Hadamard-rotated modules "
                                    "('modules': [{path, block, signs}]); without signs the codes cannot be used")
        return cls(group_size=group, bits=bits, modules=modules)


def read_pack_config(pack: Path) -> dict:
    path = Path(pack) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: an MLX pack directory holds config.json and *.safetensors")
    return json.loads(path.read_text())


def is_mlx_pack(config: dict) -> bool:
    """Cheap test: an MLX 2-bit quantization entry with rotated modules (no prism_ternary config)."""
    try:
        PackQuantization.from_config(config)
    except OfficialPackError:
        return False
    return True


def prism_config_from_pack(config: dict, signs: dict[int, str]) -> dict:
    """The vLLM checkpoint's config.json: the pack's config without MLX keys, plus prism_ternary's."""
    out = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    out["quantization_config"] = PrismTernaryConfig(bits=2, group_size=GROUP_SIZE, hadamard_block=HADAMARD_BLOCK,
                                                    signs=signs).to_dict()
    return out


# ---------------------------------------------------------------------------------------------- reader


def _conv_kernel(config: dict) -> int | None:
    return text_config(config).get("linear_conv_kernel_dim")


def _scales_fp16(name: str, scales: torch.Tensor) -> torch.Tensor:
    """Scales as fp16 (prism_ternary's dtype), refusing any value that fp16 cannot hold exactly."""
    half = scales.to(torch.float16)
    if not torch.equal(half.to(scales.dtype), scales):
        raise OfficialPackError(f"{name}.scales: {scales.dtype} values that fp16 cannot represent exactly; "
                                "converting would change the model (prism_ternary stores fp16 scales)")
    return half


def _module_tensors(ckpt: SourceCheckpoint, mlx_prefix: str, quant: PackQuantization
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int32 [out, in/16], scales fp16 [out, in/128], signs ±1 [in]) of one rotated pack module."""
    for leaf in ("weight", "scales", "biases"):
        if f"{mlx_prefix}.{leaf}" not in ckpt:
            raise OfficialPackError(f"{mlx_prefix}: '{leaf}' is missing; a 2-bit MLX module has weight, "
                                    "scales and biases")
    weight = ckpt.get(f"{mlx_prefix}.weight")
    if weight.dtype not in (torch.uint32, torch.int32):
        raise OfficialPackError(f"{mlx_prefix}.weight: dtype {weight.dtype}, expected uint32 packed codes")
    codes = weight.view(torch.int32)  # same bits: MLX packs value i of a word at bits 2i, as prism_ternary
    scales, biases = ckpt.get(f"{mlx_prefix}.scales"), ckpt.get(f"{mlx_prefix}.biases")
    if scales.shape != biases.shape or not torch.equal(biases, -scales):
        raise OfficialPackError(f"{mlx_prefix}: biases are not -scales; only then is MLX's q·scale + bias the "
                                "ternary (q - 1)·scale of prism_ternary. This module is not ternary")
    width = codes.shape[1] * 16
    _, b64 = quant.modules[mlx_prefix]
    try:
        signs = decode_signs(b64, width)
    except ValueError as e:
        raise OfficialPackError(f"{mlx_prefix}: {e}") from None
    return codes, _scales_fp16(mlx_prefix, scales), signs


def iter_dense_tensors(ckpt: SourceCheckpoint, keys: Iterable[str], config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for dense pack tensors, MLX layouts undone."""
    kernel = _conv_kernel(config)
    for key in keys:
        name = hf_name(key)
        yield name, from_mlx_layout(name, ckpt.get(key), kernel)


class PackReader(SourceCheckpoint):
    """A pack's tensors; with `skip_vision`, shards holding only the vision tower need not be present."""

    def __init__(self, root: Path, stack: contextlib.ExitStack, *, skip_vision: bool = False) -> None:
        index = Path(root) / "model.safetensors.index.json"
        if not index.is_file():
            super().__init__(root, stack)
            if skip_vision:
                self._map = {k: f for k, f in self._map.items() if not is_vision_name(k)}
            return
        self.root = Path(root)
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        self._map = {k: f for k, f in weight_map.items() if not (skip_vision and is_vision_name(k))}
        missing = sorted({f for f in self._map.values() if not (self.root / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{self.root}: shard {missing[0]} named by model.safetensors.index.json is "
                                    "missing (incomplete download?)")
        self._handles = {name: stack.enter_context(safe_open(self.root / name, framework="pt"))
                         for name in sorted(set(self._map.values()))}


def pack_files_needed(index: dict, *, vision: bool) -> list[str]:
    """Shard names of a pack index that hold what is asked: the language model (+ MTP), and the vision tower
    only if `vision`."""
    return sorted({f for k, f in index["weight_map"].items() if vision or not is_vision_name(k)})


@dataclass
class _Job:
    out_prefix: str
    parts: list[str | None]  # mlx module paths in row order


def convert_mlx_pack(pack: Path, out: Path, *, include_vision: bool = True, overwrite: bool = False,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = True) -> Path:
    """Write the vLLM prism_ternary checkpoint equivalent to an official MLX 2-bit pack at `out`.

    Codes and scales are regrouped into vLLM's fused modules (rows concatenated in Hugging Face order, as
    `bonsai-convert` does), dense tensors renamed and their MLX layouts undone. `include_vision=False`
    leaves the vision tower out (the published vLLM checkpoint has none). Returns `out`.
    """
    pack, out = Path(pack), Path(out)
    config = read_pack_config(pack)
    quant = PackQuantization.from_config(config)
    with atomic_directory(out, overwrite) as tmp, contextlib.ExitStack() as stack:
        ckpt = PackReader(pack, stack, skip_vision=not include_vision)
        keys = ckpt.keys()
        quantized = {k.removesuffix(".scales") for k in keys if k.endswith(".scales")}
        unlisted = sorted(quantized - set(quant.modules))
        if unlisted:
            raise OfficialPackError(f"{len(unlisted)} quantized modules have no Hadamard entry in config.json "
                                    f"(e.g. {unlisted[0]}); plain MLX quantization is not prism_ternary")
        absent = sorted(set(quant.modules) - quantized)
        if absent:
            raise OfficialPackError(f"config.json lists rotated modules that the weights lack (e.g. {absent[0]})")

        jobs: dict[str, _Job] = {}
        for prefix in sorted(quantized):
            target = ternary_target(hf_name(prefix))
            if target is None:
                raise OfficialPackError(f"{prefix} is quantized but prism_ternary keeps "
                                        f"{hf_name(prefix)} dense (only the language model's linear layers and "
                                        "lm_head are ternary)")
            out_prefix, index, n_parts = target
            jobs.setdefault(out_prefix, _Job(out_prefix, [None] * n_parts)).parts[index] = prefix

        consumed = {f"{p}.{leaf}" for p in quantized for leaf in ("weight", "scales", "biases")}
        dense = [k for k in keys if k not in consumed and (include_vision or not is_vision_name(k))]
        writer = ShardWriter(tmp, max_shard_bytes)
        bar = tqdm(total=len(dense) + len(jobs), unit="tensor", desc="MLX pack to prism_ternary",
                   disable=not progress)
        for name, tensor in iter_dense_tensors(ckpt, dense, config):
            writer.add(name, tensor)
            bar.update()
        signs: dict[int, torch.Tensor] = {}
        for job in jobs.values():
            if None in job.parts:
                raise OfficialPackError(f"{job.out_prefix}: a part of this fused module is missing from the pack "
                                        f"(found {job.parts})")
            tensors = [_module_tensors(ckpt, p, quant) for p in job.parts]
            codes = torch.cat([t[0] for t in tensors])
            scales = torch.cat([t[1] for t in tensors])
            width = codes.shape[1] * 16
            for part, (_, _, s) in zip(job.parts, tensors):
                if width not in signs:
                    signs[width] = s
                elif not torch.equal(signs[width], s):
                    raise OfficialPackError(f"{part}: its sign vector differs from another module of input width "
                                            f"{width}; prism_ternary shares one sign vector per width, so this "
                                            "pack cannot be expressed in it")
            qcfg = PrismTernaryConfig(bits=2, group_size=GROUP_SIZE, hadamard_block=HADAMARD_BLOCK,
                                      signs={width: encode_signs(signs[width])})
            check_module_tensors(job.out_prefix, codes, scales, codes.shape[0], width, qcfg)
            writer.add(f"{job.out_prefix}.weight", codes)
            writer.add(f"{job.out_prefix}.scales", scales)
            biases = [f"{p}.bias" for p in job.parts if f"{p}.bias" in ckpt]
            if biases:
                writer.add(f"{job.out_prefix}.bias", torch.cat([ckpt.get(b) for b in biases]))
            bar.update()
        bar.close()
        writer.close()
        cfg = prism_config_from_pack(config, {w: encode_signs(s) for w, s in signs.items()})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
        copy_side_files(pack, tmp)
    return out


def read_vision_tensors(files: Iterable[Path], config: dict) -> dict[str, torch.Tensor]:
    """The vision tower (`model.visual.*`, torch layouts) from some safetensors files of a pack."""
    kernel = _conv_kernel(config)
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key.startswith("vision_tower."):
                    if key.endswith((".scales", ".biases")):
                        raise OfficialPackError(f"{key}: the pack's vision tower is quantized; this reader takes "
                                                "only a dense (bf16/fp16) vision tower")
                    name = hf_name(key)
                    out[name] = from_mlx_layout(name, f.get_tensor(key), kernel)
    return out


# ---------------------------------------------------------------------------------------------- writer


def write_mlx_pack(dense: Path, out: Path, seed: int = 0, *, overwrite: bool = False) -> Path:
    """Write an official-layout MLX 2-bit pack of a dense Hugging Face checkpoint (a test fixture).

    The same quantizer and the same seeded sign vectors as `bonsai-convert --seed SEED`, applied to each
    unfused module: rows are quantized independently, so fusing the pack's modules afterwards gives exactly
    what converting the dense checkpoint directly gives.
    """
    from safetensors.torch import save_file

    dense, out = Path(dense), Path(out)
    config = json.loads((dense / "config.json").read_text())
    with atomic_directory(out, overwrite) as tmp, contextlib.ExitStack() as stack:
        ckpt = SourceCheckpoint(dense, stack)
        modules = sorted({_split_key(k)[0] for k in ckpt.keys()
                          if _split_key(k)[1] == "weight" and ternary_target(_split_key(k)[0])})
        if "lm_head" not in modules:
            raise ValueError(f"{dense}: no lm_head.weight (a tied LM head); the pack writer needs an untied one")
        widths = {m: ckpt.shape(f"{m}.weight")[1] for m in modules}
        signs = make_signs(list(widths.values()), seed)
        tensors: dict[str, torch.Tensor] = {}
        entries = []
        for key in ckpt.keys():
            prefix, leaf = _split_key(key)
            if prefix in widths and leaf == "weight":
                packed, scales = quantize_dense(ckpt.get(key), signs[widths[prefix]], GROUP_SIZE, HADAMARD_BLOCK)
                base = mlx_name(prefix)
                tensors[f"{base}.weight"] = packed.view(torch.uint32)
                tensors[f"{base}.scales"] = scales
                tensors[f"{base}.biases"] = -scales
                entries.append({"path": base, "block": HADAMARD_BLOCK,
                                "signs": encode_signs(signs[widths[prefix]])})
            else:
                tensors[mlx_name(key)] = to_mlx_layout(key, ckpt.get(key)).contiguous()
        # Two shards, the vision tower in the second, as a multi-gigabyte pack would be split.
        vision = {k: v for k, v in tensors.items() if is_vision_name(k)}
        shards = [{k: v for k, v in tensors.items() if k not in vision}, vision]
        shards = [s for s in shards if s]
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(dict(sorted(shard.items())), tmp / name, metadata={"format": "mlx"})
            (tmp / name).chmod(0o644)
            weight_map.update({k: name for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        pack_config = dict(config)
        pack_config["quantization"] = {"group_size": GROUP_SIZE, "bits": MLX_BITS, "mode": "affine",
                                       "modules": sorted(entries, key=lambda e: e["path"])}
        (tmp / "config.json").write_text(json.dumps(pack_config, indent=2) + "\n")
        copy_side_files(dense, tmp)
    return out


# ------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bonsai_vllm.checkpoint.official",
        description="Convert PrismML's official MLX 2-bit pack of Ternary-Bonsai into the vLLM prism_ternary "
                    "checkpoint (codes regrouped, nothing re-quantized); with --write-pack, the reverse from a "
                    "dense checkpoint (test fixtures).")
    parser.add_argument("src", type=Path, help="the MLX pack directory (or, with --write-pack, a dense checkpoint)")
    parser.add_argument("out", type=Path, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--write-pack", action="store_true", help="write an MLX pack from a dense checkpoint")
    parser.add_argument("--seed", type=int, default=0, help="sign-vector seed for --write-pack (default 0)")
    parser.add_argument("--no-vision", action="store_true", help="leave the vision tower out")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    if args.write_pack:
        out = run_cli(parser, lambda: write_mlx_pack(args.src, args.out, args.seed, overwrite=args.overwrite))
    else:
        out = run_cli(parser, lambda: convert_mlx_pack(args.src, args.out, include_vision=not args.no_vision,
                                                       overwrite=args.overwrite))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
