"""The official-pack reader refuses a pack that breaks one of its layout rules, naming the rule, instead of
mis-reading it (checkpoint/official.py; the happy path is in test_fetch_build.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bonsai_vllm.ternary.format import decode_signs, encode_signs
from bonsai_vllm.checkpoint.official import OfficialPackError, convert_mlx_pack, hf_name, mlx_name

MODULE = "language_model.model.layers.0.mlp.gate_proj"


def _copy(pack: Path, dst: Path) -> Path:
    shutil.copytree(pack, dst)
    return dst


def _edit_config(pack: Path, edit) -> None:
    cfg = json.loads((pack / "config.json").read_text())
    edit(cfg)
    (pack / "config.json").write_text(json.dumps(cfg))


def _module_entry(cfg: dict, path: str) -> dict:
    return next(m for m in cfg["quantization"]["modules"] if m["path"] == path)


def test_biases_must_be_minus_scales(fixture_models, tmp_path):
    pack = _copy(fixture_models.pack, tmp_path / "pack")
    shard = pack / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    tensors[f"{MODULE}.biases"] = torch.zeros_like(tensors[f"{MODULE}.biases"])  # plain affine, not ternary
    save_file(tensors, shard)
    with pytest.raises(OfficialPackError, match="biases are not -scales"):
        convert_mlx_pack(pack, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_one_sign_vector_per_width(fixture_models, tmp_path):
    pack = _copy(fixture_models.pack, tmp_path / "pack")

    def flip(cfg: dict) -> None:
        entry = _module_entry(cfg, MODULE)
        signs = decode_signs(entry["signs"], 1024)
        signs[0] = -signs[0]
        entry["signs"] = encode_signs(signs)

    _edit_config(pack, flip)
    with pytest.raises(OfficialPackError, match="differs from another module of input width 1024"):
        convert_mlx_pack(pack, tmp_path / "out", progress=False)


@pytest.mark.parametrize("edit, words", [
    (lambda cfg: cfg["quantization"].update(bits=4), "only the 2-bit affine pack"),
    (lambda cfg: _module_entry(cfg, MODULE).update(block=512), "Hadamard block 512"),
    (lambda cfg: cfg["quantization"].update(modules=[m for m in cfg["quantization"]["modules"]
                                                     if m["path"] != MODULE]), "no Hadamard entry"),
])
def test_layout_rules_are_named(fixture_models, tmp_path, edit, words):
    pack = _copy(fixture_models.pack, tmp_path / "pack")
    _edit_config(pack, edit)
    with pytest.raises(OfficialPackError, match=words):
        convert_mlx_pack(pack, tmp_path / "out", progress=False)


def test_names_map_both_ways():
    for hf in ("model.language_model.layers.3.self_attn.q_proj.weight", "lm_head.weight", "mtp.fc.weight",
               "model.visual.blocks.0.attn.qkv.weight"):
        assert hf_name(mlx_name(hf)) == hf
    assert hf_name("model.layers.0.mlp.down_proj.weight") == "model.language_model.layers.0.mlp.down_proj.weight"
    assert mlx_name("lm_head") == "language_model.lm_head"
