"""The fixture repos of the model-fetch tests (see conftest.py for what each holds).

A module of its own, not conftest.py: with several test directories each holding a conftest.py, `from conftest
import ...` resolves to whichever was imported first.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO_VLLM = "fraserprice/Ternary-Bonsai-2-27B-vllm"
REPO_OFFICIAL = "prism-ml/Ternary-Bonsai-2-27B-mlx-2bit"
REPO_BASE = "Qwen/Qwen3.8-27B"  # the model's own base: its vision tower
REPO_OTHER_BASE = "Qwen/Qwen3.5-27B"  # same architecture and shapes, another model
REPO_MTP = "bonsai-ja/Ternary-Bonsai-2-27B-mtp-ja"
REPO_PRIVATE = "someone/private-copy"
REPO_TEXT_ONLY = "someone/text-only-upload"
TOKEN = "hf_fixture_token"
SIGN_SEED = 7  # the sign vectors of both the upload and the pack


def _save_shards(out: Path, tensors: dict[str, torch.Tensor], groups: list[Callable[[str], bool]]) -> None:
    """Split tensors into shards by predicate (first match wins) and write an index."""
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in groups]
    for name, t in tensors.items():
        shards[next(i for i, g in enumerate(groups) if g(name))][name] = t
    shards = [s for s in shards if s]
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
         "weight_map": dict(sorted(weight_map.items()))}, indent=2))


def _copy_side(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in skip \
                and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)


@dataclass
class Fixture:
    root: Path
    dense: Path  # the tiny dense multimodal model with its MTP head
    ternary: Path  # bonsai-convert of it, vision tower included (the reference of every route)
    upload: Path
    base: Path
    pack: Path
    mtp_dir: Path
    counts: Path
    text_only: Path
    other_base: Path  # the base repo again, its model card naming another model (Qwen3.5-27B)

    def mtp_ja(self) -> dict[str, torch.Tensor]:
        return load_file(self.mtp_dir / "mtp.safetensors")


def build_fixture(root: Path) -> Fixture:
    """Write the tiny model and every fixture repo under `root`."""
    from bonsai_vllm.checkpoint.convert import convert_to_ternary
    from bonsai_vllm.checkpoint.official import write_mlx_pack
    from bonsai_vllm.testing.tiny import TinyVision, make_mtp_tensors, write_tiny
    from transformers import Qwen3_5TextConfig

    dense = write_tiny(root / "dense", seed=0, mtp=True, vision=TinyVision())
    ternary = convert_to_ternary(dense, root / "ternary", seed=SIGN_SEED, progress=False)

    # The vLLM upload: the ternary checkpoint without its vision tower (as published), in 3 shards: the MTP
    # head shares the last one with the final norm, so fetching must split a shard.
    tern = load_file(ternary / "model.safetensors")
    upload = root / "upload"
    _save_shards(upload, {k: v for k, v in tern.items() if not k.startswith("model.visual.")},
                 [lambda k: ".layers.0." in k or ".layers.1." in k or "embed_tokens" in k,
                  lambda k: not k.startswith("mtp.") and not k.endswith("language_model.norm.weight"),
                  lambda k: True])
    shutil.copy2(ternary / "config.json", upload / "config.json")
    _copy_side(ternary, upload, skip=("config.json", "preprocessor_config.json"))

    # The dense base model: the vision tower alone in the last of 3 shards.
    full = load_file(dense / "model.safetensors")
    base = root / "base"
    _save_shards(base, full, [lambda k: ".layers.0." in k or ".layers.1." in k,
                              lambda k: not k.startswith("model.visual."), lambda k: True])
    _copy_side(dense, base)

    pack = write_mlx_pack(dense, root / "pack", seed=SIGN_SEED)

    # Model cards as the Hub keeps them: the upload and the pack name the base model in their front matter.
    for d in (upload, pack):
        (d / "README.md").write_text(f"---\nlicense: apache-2.0\nbase_model:\n- {REPO_BASE}\n---\n# {d.name}\n")
    (base / "README.md").write_text("---\nlicense: apache-2.0\n---\n# the dense base model\n")
    other_base = root / "other-base"
    shutil.copytree(base, other_base)
    (other_base / "README.md").write_text(f"---\nbase_model: {REPO_OTHER_BASE}-Base\n---\n# another model\n")

    text = Qwen3_5TextConfig(**json.loads((dense / "config.json").read_text())["text_config"])
    mtp_dir = root / "mtp"
    mtp_dir.mkdir()
    head = make_mtp_tensors(text, seed=123)
    save_file(head, mtp_dir / "mtp.safetensors", metadata={"format": "pt"})
    misfit = dict(head)
    misfit["mtp.fc.weight"] = misfit["mtp.fc.weight"][:, :1024].contiguous()  # half the input width
    save_file(misfit, mtp_dir / "mtp-misfit.safetensors", metadata={"format": "pt"})
    (mtp_dir / "README.md").write_text("A Japanese-trained MTP head (fixture).\n")

    vocab = text.vocab_size
    counts = root / "token_counts.json"
    counts.write_text(json.dumps({str(i): (vocab - i) * 3 if i % 2 else 1 for i in range(vocab)}))

    # A text-only upload: flat qwen3_5_text config, language model under model.* (one file, no index).
    text_only = root / "text-only"
    text_only.mkdir()
    save_file({k.replace("model.language_model.", "model.", 1): v for k, v in tern.items()
               if not k.startswith("model.visual.")}, text_only / "model.safetensors", metadata={"format": "pt"})
    mm = json.loads((ternary / "config.json").read_text())
    flat = {**mm["text_config"], "architectures": ["Qwen3_5ForCausalLM"],
            "quantization_config": mm["quantization_config"]}
    (text_only / "config.json").write_text(json.dumps(flat, indent=2))
    _copy_side(ternary, text_only, skip=("config.json", "preprocessor_config.json"))
    return Fixture(root, dense, ternary, upload, base, pack, mtp_dir, counts, text_only, other_base)
