"""checkpoint/convert.py (`bonsai-convert`) on the tiny Qwen3.5-hybrid checkpoint, both directions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bonsai_vllm.checkpoint import convert as convert_mod
from bonsai_vllm.testing import tiny as tiny_mod
from bonsai_vllm.checkpoint.convert import convert_to_dense, convert_to_ternary, main, make_signs
from bonsai_vllm.ternary.format import PrismTernaryConfig, check_module_tensors, decode_signs, is_ternary_module
from bonsai_vllm.ternary.quantize import dense_from_ternary

FUSED = {  # vLLM fused name -> HF parts in row order, the spec of docs/format.md
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "linear_attn.in_proj_qkvz": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
}


def _load(d: Path) -> dict[str, torch.Tensor]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out = {}
        for f in files:
            out.update(load_file(d / f))
        return out
    return load_file(d / "model.safetensors")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """The tiny dense checkpoint, its prism_ternary conversion and the dense round trip."""
    root = tmp_path_factory.mktemp("convert")
    dense = tiny_mod.write_tiny(root / "dense", seed=0)
    tern = convert_to_ternary(dense, root / "ternary", seed=0, progress=False)
    back = convert_to_dense(tern, root / "back", progress=False)
    return {"root": root, "dense": dense, "ternary": tern, "back": back}


def test_ternary_checkpoint_layout(ckpts):
    src, out = _load(ckpts["dense"]), _load(ckpts["ternary"])
    config = json.loads((ckpts["ternary"] / "config.json").read_text())
    q = config["quantization_config"]
    assert {k: q[k] for k in ("quant_method", "bits", "group_size", "hadamard_block")} == \
        {"quant_method": "prism_ternary", "bits": 2, "group_size": 128, "hadamard_block": 1024}
    assert sorted(q["signs"]) == ["1024", "3072"]  # hidden (qkv, gate_up, qkvz, o/out, lm_head), intermediate
    cfg = PrismTernaryConfig.from_dict(q)

    ternary_prefixes = sorted(k.removesuffix(".scales") for k in out if k.endswith(".scales"))
    # 3 GDN layers × (in_proj_qkvz, out_proj) + 1 attention × (qkv_proj, o_proj) + 4 × (gate_up, down) + lm_head
    assert len(ternary_prefixes) == 3 * 2 + 2 + 4 * 2 + 1
    assert all(is_ternary_module(p) for p in ternary_prefixes)
    for p in ternary_prefixes:
        w, s = out[f"{p}.weight"], out[f"{p}.scales"]
        check_module_tensors(p, w, s, w.shape[0], w.shape[1] * 16, cfg)
    # Fused rows: out features are the sum of the HF parts'.
    assert out["model.layers.3.self_attn.qkv_proj.weight"].shape == (2048 + 512 + 512, 1024 // 16)
    assert out["model.layers.0.linear_attn.in_proj_qkvz.weight"].shape == (2048 + 1024, 1024 // 16)
    assert out["model.layers.0.mlp.gate_up_proj.scales"].shape == (2 * 3072, 1024 // 128)
    assert out["model.layers.0.mlp.down_proj.weight"].shape == (1024, 3072 // 16)
    # No HF part name survives, and everything not ternary is copied bit for bit.
    assert not any(k.endswith(("q_proj.weight", "gate_proj.weight", "in_proj_qkv.weight")) for k in out)
    dense_keys = [k for k in src if not is_ternary_module(k.rsplit(".", 1)[0]) and not any(
        k.endswith(f"{part}.weight") for parts in FUSED.values() for part in parts)]
    assert "model.embed_tokens.weight" in dense_keys and "model.layers.0.linear_attn.in_proj_a.weight" in dense_keys
    for k in dense_keys:
        assert out[k].dtype == src[k].dtype and torch.equal(out[k], src[k]), k
    assert set(out) == set(dense_keys) | {f"{p}.{leaf}" for p in ternary_prefixes for leaf in ("weight", "scales")}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (ckpts["ternary"] / name).read_bytes() == (ckpts["dense"] / name).read_bytes()


def test_signs_are_seeded_per_width(ckpts):
    q = json.loads((ckpts["ternary"] / "config.json").read_text())["quantization_config"]
    want = make_signs([1024, 3072], seed=0)
    for width, vec in want.items():
        assert torch.equal(decode_signs(q["signs"][str(width)], width), vec)
    assert not torch.equal(make_signs([1024], seed=1)[1024], want[1024])
    assert 400 < int((want[1024] < 0).sum()) < 624  # about half negative


def test_fused_rows_follow_hf_order(ckpts):
    """Each fused block of rows approximates its own HF part (cosine ≈ 0.89 for a ternary Gaussian);
    a wrong row order would pair a part with another's rows (cosine ≈ 0)."""
    src, out = _load(ckpts["dense"]), _load(ckpts["ternary"])
    cfg = PrismTernaryConfig.from_dict(json.loads((ckpts["ternary"] / "config.json").read_text())
                                       ["quantization_config"])
    for layer, fused in ((3, "self_attn.qkv_proj"), (0, "mlp.gate_up_proj"), (0, "linear_attn.in_proj_qkvz")):
        p = f"model.layers.{layer}.{fused}"
        w = out[f"{p}.weight"]
        dense = dense_from_ternary(w, out[f"{p}.scales"], cfg.sign_vector(w.shape[1] * 16), 128, 1024)
        start = 0
        for part in FUSED[fused]:
            orig = src[f"model.layers.{layer}.{part}.weight"].float()
            rows = dense[start:start + orig.shape[0]]
            cos = torch.nn.functional.cosine_similarity(rows.flatten(), orig.flatten(), dim=0)
            assert cos > 0.85, (p, part, float(cos))
            start += orig.shape[0]
        assert start == dense.shape[0]


def test_round_trip_to_dense_names_shapes_values(ckpts):
    src, tern, back = _load(ckpts["dense"]), _load(ckpts["ternary"]), _load(ckpts["back"])
    assert set(back) == set(src)
    for k in src:
        assert back[k].shape == src[k].shape and back[k].dtype == torch.bfloat16, k
    cfg = PrismTernaryConfig.from_dict(json.loads((ckpts["ternary"] / "config.json").read_text())
                                       ["quantization_config"])
    # Values: dense_from_ternary of the stored tensors, split back into the HF parts.
    for p in (k.removesuffix(".scales") for k in tern if k.endswith(".scales")):
        w = tern[f"{p}.weight"]
        want = dense_from_ternary(w, tern[f"{p}.scales"], cfg.sign_vector(w.shape[1] * 16), 128, 1024)
        # "model.layers.3.self_attn.qkv_proj" -> owner "model.layers.3", module "self_attn.qkv_proj"
        owner, module = (p.rsplit(".", 2)[0], ".".join(p.rsplit(".", 2)[1:])) if "." in p else ("", p)
        parts = FUSED.get(module, (module,))
        got = torch.cat([back[f"{owner}.{part}.weight" if owner else f"{part}.weight"] for part in parts])
        assert torch.equal(got, want.to(torch.bfloat16)), p
    # Non-ternary tensors unchanged; config back to the original.
    conv = "model.layers.0.linear_attn.conv1d.weight"
    assert torch.equal(back[conv], src[conv])
    assert json.loads((ckpts["back"] / "config.json").read_text()) == \
        json.loads((ckpts["dense"] / "config.json").read_text())


def test_output_files_are_readable_by_others(ckpts):
    # safetensors 0.8 creates files 0600 and mkdtemp 0700: the converter restores umask permissions.
    assert (ckpts["ternary"] / "model.safetensors").stat().st_mode & 0o044 == 0o044
    assert ckpts["ternary"].stat().st_mode & 0o055 == 0o055


def test_existing_out_is_refused_and_kept(ckpts):
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert_to_ternary(ckpts["dense"], ckpts["ternary"], progress=False)
    assert (ckpts["ternary"] / "model.safetensors").exists()
    with pytest.raises(SystemExit) as exc:
        main([str(ckpts["dense"]), str(ckpts["ternary"]), "--no-progress"])
    assert exc.value.code == 1


def test_failure_leaves_no_out_and_no_temporary(ckpts, monkeypatch):
    calls = []

    def fail_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk full")
        return real(*args, **kwargs)

    real = convert_mod.quantize_dense
    monkeypatch.setattr(convert_mod, "quantize_dense", fail_on_third)
    out = ckpts["root"] / "failed"
    with pytest.raises(RuntimeError, match="disk full"):
        convert_to_ternary(ckpts["dense"], out, progress=False)
    assert not out.exists()
    assert not [p for p in ckpts["root"].iterdir() if p.name.startswith(".failed")]


def test_refuses_wrong_direction(ckpts, tmp_path):
    with pytest.raises(ValueError, match="already has a quantization_config"):
        convert_to_ternary(ckpts["ternary"], tmp_path / "x", progress=False)
    with pytest.raises(ValueError, match="no prism_ternary quantization_config"):
        convert_to_dense(ckpts["dense"], tmp_path / "y", progress=False)


def test_to_dense_rejects_config_mismatch(ckpts, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ckpts["ternary"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] = 2048
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"gate_up_proj: 6144 rows cannot be split"):
        convert_to_dense(bad, tmp_path / "out", progress=False)


def test_multimodal_names_sharded_input_and_output_mtp_visual(ckpts, tmp_path):
    """A qwen3_5 (multimodal) layout: sizes under text_config, weights under model.language_model.,
    mtp.* and model.visual.* copied untouched; sharded in, sharded out."""
    src = _load(ckpts["dense"])
    keep = [k for k in src if not k.startswith(("model.layers.1.", "model.layers.2."))]  # 1 GDN + 1 attn
    mm = {("lm_head.weight" if k == "lm_head.weight" else k.replace("model.", "model.language_model.", 1)): src[k]
          for k in keep}
    gen = torch.Generator().manual_seed(0)
    extra = {
        "model.visual.blocks.0.attn.qkv.weight": torch.randn(48, 16, generator=gen).bfloat16(),
        "mtp.layers.0.self_attn.q_proj.weight": torch.randn(2048, 1024, generator=gen).bfloat16(),
        "mtp.layers.0.mlp.down_proj.weight": torch.randn(1024, 3072, generator=gen).bfloat16(),
        "mtp.fc.weight": torch.randn(1024, 2048, generator=gen).bfloat16(),
    }
    mm.update(extra)
    d = tmp_path / "mm"
    d.mkdir()
    keys = sorted(mm)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in shards.items():
        save_file({k: mm[k].contiguous() for k in ks}, d / name)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    text = json.loads((ckpts["dense"] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
         "tie_word_embeddings": False, "text_config": text, "vision_config": {"depth": 1}}))

    tern = convert_to_ternary(d, tmp_path / "mm-ternary", seed=0, progress=False, max_shard_bytes=4 * 10**6)
    index = json.loads((tern / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (tern / "model.safetensors").exists()
    out = _load(tern)
    assert out["model.language_model.layers.3.self_attn.qkv_proj.weight"].dtype == torch.int32
    assert out["model.language_model.layers.0.linear_attn.in_proj_qkvz.scales"].shape == (3072, 8)
    assert out["lm_head.weight"].dtype == torch.int32
    for k, v in extra.items():  # drafter and vision tower: unchanged, under their HF names
        assert torch.equal(out[k], v), k
    assert not any(k.startswith("mtp.") and k.endswith(".scales") for k in out)  # the drafter stays bf16

    back = convert_to_dense(tern, tmp_path / "mm-back", progress=False)
    got = _load(back)
    assert set(got) == set(mm)
    assert all(got[k].shape == mm[k].shape for k in mm)
    assert torch.equal(got["mtp.layers.0.self_attn.q_proj.weight"], extra["mtp.layers.0.self_attn.q_proj.weight"])
    assert "quantization_config" not in json.loads((back / "config.json").read_text())


def test_tied_embeddings_get_a_ternary_lm_head(ckpts, tmp_path):
    d = tmp_path / "tied"
    d.mkdir()
    src = _load(ckpts["dense"])
    keep = {k: v for k, v in src.items() if k.startswith(("model.embed_tokens", "model.layers.0.mlp.", "model.norm"))}
    save_file(keep, d / "model.safetensors")
    config = json.loads((ckpts["dense"] / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(config))
    tern = convert_to_ternary(d, tmp_path / "tied-t", progress=False)
    with safe_open(tern / "model.safetensors", "pt") as f:
        assert f.get_slice("lm_head.weight").get_shape() == [768, 64]
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    assert json.loads((tern / "config.json").read_text())["tie_word_embeddings"] is False


def test_cli_help_and_tiny_ternary_flag(ckpts, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert "--to-dense" in help_text and "--seed" in help_text

    # bonsai-tiny --ternary: write (here: copy the fixture's dense model, to save time), convert in place.
    def fake_write_tiny(out_dir, seed=0, shape=None):
        shutil.copytree(ckpts["dense"], out_dir)
        return Path(out_dir)

    monkeypatch.setattr(tiny_mod, "write_tiny", fake_write_tiny)
    out = tmp_path / "tiny-t"
    assert tiny_mod.main([str(out), "--ternary"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "prism_ternary"
    assert torch.equal(load_file(out / "model.safetensors")["lm_head.weight"],
                       _load(ckpts["ternary"])["lm_head.weight"])  # same seed, same checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-t"]  # no temporaries left
