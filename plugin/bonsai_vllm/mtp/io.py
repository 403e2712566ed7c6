"""The model's frozen parts the MTP head trains through, and writing the new head.

The head is written as `mtp.safetensors` with exactly the checkpoint's `mtp.*` names, dtypes and shapes
(model-fetch's MTP swap checks the same: docs/model-fetch.md), atomically: a temporary file in the target
folder renamed over the target, so a full disk or a stopped run never leaves a half-written head.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bonsai_vllm.checkpoint.io import umask
from bonsai_vllm.mtp.head import HeadShape
from bonsai_vllm.ternary.format import PrismTernaryConfig
from bonsai_vllm.ternary.reference import dequantize, signed_block_hadamard


class MTPInputError(ValueError):
    """Bad input to bonsai-mtp-train: the message says what is wrong and what to do."""


@dataclass
class Frozen:
    """What the head trains through, frozen: the embedding, the final norm and the LM head."""

    shape: HeadShape
    num_hidden_layers: int
    embed: torch.Tensor          # [vocab, H]
    final_norm: torch.Tensor     # [H] (Qwen3.5: scales by 1 + w)
    lm_head: torch.Tensor        # [vocab, H], dense (ternary: dequantized, still in the rotated domain)
    lm_head_signs: torch.Tensor | None  # ternary LM head: y = W' · H(s ⊙ x) per block
    hadamard_block: int
    head: dict[str, torch.Tensor]       # the checkpoint's mtp.* tensors, names without "mtp."

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head_signs is not None:
            x = signed_block_hadamard(x.float(), self.lm_head_signs, self.hadamard_block).to(x.dtype)
        return x @ self.lm_head.to(x.dtype).t()


def _tensors(model_dir: Path) -> dict[str, tuple[Path, str]]:
    where: dict[str, tuple[Path, str]] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                where[name] = (shard, name)
    return where


def _load(where: dict[str, tuple[Path, str]], name: str) -> torch.Tensor:
    shard, key = where[name]
    with safe_open(str(shard), "pt") as f:
        return f.get_tensor(key)


def _one(where: dict[str, tuple[Path, str]], suffixes: tuple[str, ...], what: str, model_dir: Path) -> str:
    for suffix in suffixes:
        hits = [n for n in where if (n == suffix or n.endswith("." + suffix)) and not n.startswith("mtp.")
                and "visual" not in n]
        if len(hits) == 1:
            return hits[0]
    raise MTPInputError(f"{model_dir}: no single {what} tensor ({' or '.join(suffixes)}) among its safetensors")


def load_frozen(model_dir: Path) -> Frozen:
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise MTPInputError(f"{model_dir}: not a model folder (no config.json)")
    config = json.loads(cfg_path.read_text())
    text = config.get("text_config", config)
    where = _tensors(model_dir)
    head = {n.removeprefix("mtp."): _load(where, n) for n in sorted(where) if n.startswith("mtp.")}
    if not head:
        raise MTPInputError(f"{model_dir} has no mtp.* tensors: there is no MTP head to retrain (the served "
                            "checkpoint must carry one; its names, dtypes and shapes are the output's)")
    shape = HeadShape.from_config(config)
    embed = _load(where, _one(where, ("language_model.embed_tokens.weight", "embed_tokens.weight"),
                              "embedding", model_dir))
    norm = _load(where, _one(where, ("language_model.norm.weight", "model.norm.weight"), "final norm", model_dir))
    lm_name = _one(where, ("lm_head.weight",), "LM head", model_dir)
    lm = _load(where, lm_name)
    signs, block = None, 1024
    if lm.dtype == torch.int32:  # prism_ternary-packed LM head
        qcfg = PrismTernaryConfig.from_dict(config["quantization_config"])
        scales = _load(where, lm_name.removesuffix(".weight") + ".scales")
        lm = dequantize(lm, scales, qcfg.group_size).to(torch.bfloat16)
        signs, block = qcfg.sign_vector(lm.shape[1]), qcfg.hadamard_block
    fc = head.get("fc.weight")
    for name, width in (("embedding", embed.shape[-1]), ("LM head", lm.shape[-1]),
                        ("mtp.fc (over two hidden states)", None if fc is None else fc.shape[-1] // 2)):
        if width is not None and width != shape.hidden_size:
            raise MTPInputError(f"{model_dir}: {name} has width {width} but config hidden_size is "
                                f"{shape.hidden_size}")
    return Frozen(shape=shape, num_hidden_layers=int(text["num_hidden_layers"]), embed=embed, final_norm=norm,
                  lm_head=lm, lm_head_signs=signs, hadamard_block=block, head=head)


def write_head(out: Path, head: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> Path:
    """Write `head` (names without "mtp.") as `out` in the original's names, dtypes and shapes, atomically."""
    out = Path(out)
    if set(head) != set(original):
        raise MTPInputError(f"head tensors differ from the checkpoint's: {sorted(set(head) ^ set(original))[:3]}")
    tensors = {}
    for name, ref in original.items():
        t = head[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise MTPInputError(f"mtp.{name}: shape {list(t.shape)} but the checkpoint has {list(ref.shape)}")
        tensors[f"mtp.{name}"] = t.detach().to("cpu", ref.dtype).contiguous()
    need = sum(t.numel() * t.element_size() for t in tensors.values()) + (1 << 20)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise MTPInputError(f"{out.parent}: {free / 2**20:.1f} MiB free but the head needs {need / 2**20:.1f} MiB;"
                            " free some space or write elsewhere (--out)")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_file(dict(sorted(tensors.items())), str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, 0o666 & ~umask())  # as an ordinary file: readable by the server's user
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise MTPInputError(f"{out.parent}: the disk filled up while writing {out.name}; nothing was "
                                "replaced. Free some space or write elsewhere (--out)") from e
        raise
    return out
