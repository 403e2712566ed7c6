"""bonsai-fetch end to end against the local Hub: the full fetch and rewrite, reruns, changed options, and the
official-pack route giving the very tensors of the vLLM upload."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bonsai_fetch.build import MANIFEST, MARKER, tensors_of
from bonsai_vllm.embeddings import open_table
from bonsai_vllm.checkpoint.official import convert_mlx_pack
from fetch_repos import REPO_BASE, REPO_MTP, REPO_OFFICIAL, REPO_TEXT_ONLY, REPO_VLLM

UPLOAD_SHARDS = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                 "model-00003-of-00003.safetensors"]


def _files(d: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (inode, mtime_ns) of every file, to see what a rerun touched."""
    return {str(p.relative_to(d)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def full(tmp_path_factory, hub_session, fixture_models):
    """One full fetch with every feature on: vision from the base, the JA MTP head, counts-ranked SSD export."""
    from bonsai_fetch.cli import main

    hub_session.reset_faults()
    out = tmp_path_factory.mktemp("full") / "model"
    code = main(["--no-progress", "--out", str(out), "--mtp-repo", REPO_MTP, "--hot-vocab", "64",
                 "--token-counts", str(fixture_models.counts)],
                env={"HF_ENDPOINT": hub_session.url, "BONSAI_FETCH_RETRIES": "0"})
    assert code == 0
    return out, list(hub_session.log)


def test_full_fetch_and_rewrite(full, fixture_models):
    out, log = full
    ref = load_file(fixture_models.ternary / "model.safetensors")  # bonsai-convert of the dense model
    got = tensors_of(out)

    # Config: the multimodal layout vLLM 0.32 expects, the language model's sizes under text_config.
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and cfg["model_type"] == "qwen3_5"
    assert cfg["text_config"]["model_type"] == "qwen3_5_text" and cfg["text_config"]["hidden_size"] == 1024
    assert cfg["vision_config"]["depth"] == 2 and cfg["vision_config"]["out_hidden_size"] == 1024
    assert cfg["quantization_config"] == json.loads((fixture_models.ternary / "config.json").read_text())[
        "quantization_config"]
    assert (out / "preprocessor_config.json").is_file() and (out / "tokenizer.json").is_file()

    # Names as vLLM's weight mapper wants them; every language and vision tensor is the reference's.
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in got} >= {"model.language_model", "model.visual",
                                                                      "lm_head.weight", "mtp.fc"}
    assert set(got) == set(ref)
    for name, t in got.items():
        if not name.startswith("mtp."):
            assert t.dtype == ref[name].dtype and torch.equal(t, ref[name]), name
    # The MTP head is the replacement, byte for byte; the vision tower the base model's.
    ja = fixture_models.mtp_ja()
    assert all(torch.equal(got[k], v) for k, v in ja.items()) and not torch.equal(got["mtp.fc.weight"],
                                                                                    ref["mtp.fc.weight"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["mtp.fc.weight"] == "mtp.safetensors"
    assert index["weight_map"]["model.visual.merger.linear_fc2.weight"] == "visual.safetensors"

    # The SSD embedding export: THE format of embeddings.py, hot rows ranked by the counts file.
    meta, table = open_table(out / "embed_ssd")
    assert torch.equal(table, ref["model.language_model.embed_tokens.weight"])
    counts = {int(k): v for k, v in json.loads(fixture_models.counts.read_text()).items()}
    assert meta.hot_ids == sorted(counts, key=lambda i: (-counts[i], i))[:64]

    # Manifest: sources with commits, options, the sha256 of every file; the marker vouches for it.
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["sources"]["weights"]["repo"] == REPO_VLLM and len(manifest["sources"]["weights"]["commit"]) == 40
    assert manifest["sources"]["mtp"]["repo"] == REPO_MTP and manifest["request"]["embed"]["hot_vocab"] == 64
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {MANIFEST, MARKER}
    assert set(manifest["files"]) == on_disk
    for rel, entry in manifest["files"].items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == entry["sha256"], rel
    assert (out / MARKER).read_text().strip() == hashlib.sha256((out / MANIFEST).read_bytes()).hexdigest()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial")]

    # Only what is needed came down: the base repo's vision shard, not its two language-model shards.
    got_base = {r.path.rsplit("/", 1)[-1] for r in log if r.method == "GET" and r.path.startswith(f"/{REPO_BASE}/")}
    assert "model-00003-of-00003.safetensors" in got_base
    assert not {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"} & got_base
    got_mtp = {r.path.rsplit("/", 1)[-1] for r in log if r.method == "GET" and r.path.startswith(f"/{REPO_MTP}/")}
    assert got_mtp == {"mtp.safetensors"}


def test_rerun_is_a_noop(full, fetch, hub, fixture_models):
    out, _ = full
    before = _files(out)
    run = fetch("--out", str(out), "--mtp-repo", REPO_MTP, "--hot-vocab", "64",
                "--token-counts", str(fixture_models.counts))
    assert run.code == 0 and "up to date" in run.out and "nothing to do" in run.out
    assert _files(out) == before  # not a file touched
    assert hub.resolve_gets() == []  # nothing downloaded; only the revisions were looked up


def test_changed_options_rebuild_only_what_they_affect(tmp_path, fetch, hub, fixture_models):
    out = tmp_path / "model"
    assert fetch("--out", str(out), "--hot-vocab", "32").code == 0
    before = _files(out)
    embed_bin = (out / "embed_ssd" / "embed_tokens.bin").read_bytes()

    # A new hot size: only the embedding export is rewritten; the shards are the same inodes (linked).
    hub.log.clear()
    run = fetch("--out", str(out), "--hot-vocab", "16")
    assert run.code == 0 and "built embed" in run.out, run.out
    after = _files(out)
    for shard in UPLOAD_SHARDS + ["visual.safetensors", "mtp.safetensors", "tokenizer.json"]:
        assert after[shard][0] == before[shard][0], shard
    assert json.loads((out / "embed_ssd" / "embed_tokens.json").read_text())["hot_ids"] == list(range(16))
    assert (out / "embed_ssd" / "embed_tokens.bin").read_bytes() == embed_bin
    assert hub.resolve_gets() == []

    # Swap in the JA head: only mtp.safetensors changes and only the head is downloaded.
    run = fetch("--out", str(out), "--hot-vocab", "16", "--mtp-repo", REPO_MTP)
    assert run.code == 0 and "built mtp" in run.out, run.out
    assert torch.equal(load_file(out / "mtp.safetensors")["mtp.fc.weight"], fixture_models.mtp_ja()["mtp.fc.weight"])
    assert {r.path.rsplit("/", 1)[-1] for r in hub.resolve_gets()} == {"mtp.safetensors"}
    assert _files(out)[UPLOAD_SHARDS[0]][0] == before[UPLOAD_SHARDS[0]][0]

    # And back to the checkpoint's own head (JA_MTP=0 in report 002's terms, §6 in docs/field-reports.md).
    assert fetch("--out", str(out), "--hot-vocab", "16").code == 0
    ref = load_file(fixture_models.ternary / "model.safetensors")
    assert torch.equal(load_file(out / "mtp.safetensors")["mtp.fc.weight"], ref["mtp.fc.weight"])

    # Vision off: a text-only model directory (no vision tensors, text config at the top).
    assert fetch("--out", str(out), "--hot-vocab", "16", "--vision-repo", "off").code == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForCausalLM"] and cfg["model_type"] == "qwen3_5_text"
    assert "vision_config" not in cfg and not (out / "visual.safetensors").exists()
    assert not any(k.startswith("model.visual.") for k in tensors_of(out))
    assert _files(out)[UPLOAD_SHARDS[0]][0] == before[UPLOAD_SHARDS[0]][0]


def test_official_pack_converts_to_the_same_checkpoint(fixture_models, tmp_path):
    """The converter alone: MLX pack -> prism_ternary equals bonsai-convert of the dense model, vision
    tower and MTP head included, config too."""
    conv = convert_mlx_pack(fixture_models.pack, tmp_path / "conv", progress=False)
    a = tensors_of_dir(fixture_models.ternary)
    b = tensors_of_dir(conv)
    assert set(a) == set(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((conv / "config.json").read_text()) == \
        json.loads((fixture_models.ternary / "config.json").read_text())


def test_official_route_gives_identical_tensors(full, fetch, hub, fixture_models, tmp_path):
    """The vLLM upload gone (404): auto falls back to the official pack, and the model directory has the very
    tensors and config of the upload route."""
    out = tmp_path / "model"
    run = fetch("--out", str(out), "--model-repo", "fraserprice/gone", "--mtp-repo", REPO_MTP,
                "--hot-vocab", "64", "--token-counts", str(fixture_models.counts), env={"HF_TOKEN": "hf_fixture_token"})
    assert run.code == 0, run.out
    assert "official pack" in run.out
    manifest = json.loads((out / MANIFEST).read_text())
    assert (manifest["sources"]["weights"]["route"], manifest["sources"]["weights"]["repo"]) == \
        ("official", REPO_OFFICIAL)
    a, b = tensors_of(full[0]), tensors_of(out)
    assert set(a) == set(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "config.json").read_text()) == json.loads((full[0] / "config.json").read_text())
    embed = Path("embed_ssd") / "embed_tokens.bin"
    assert (out / embed).read_bytes() == (full[0] / embed).read_bytes()
    # The pack's vision-only shard was not downloaded: the vision tower came from the base repo.
    assert not hub.requests_for(REPO_OFFICIAL, "model-00002-of-00002.safetensors")


def tensors_of_dir(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_write_mlx_pack_layout(fixture_models):
    """The fixture pack has the official layout: uint32 codes, biases = -scales, a signs entry per module."""
    cfg = json.loads((fixture_models.pack / "config.json").read_text())
    q = cfg["quantization"]
    assert q["bits"] == 2 and q["group_size"] == 128 and all(m["block"] == 1024 for m in q["modules"])
    t = tensors_of_dir(fixture_models.pack)
    name = "language_model.model.layers.3.self_attn.q_proj"
    assert t[f"{name}.weight"].dtype == torch.uint32 and torch.equal(t[f"{name}.biases"], -t[f"{name}.scales"])
    assert t["vision_tower.patch_embed.proj.weight"].shape[-1] == 3  # channels-last, as MLX stores convolutions


def test_vision_tower_from_an_mlx_pack(full, fetch, hub, tmp_path):
    """The vision source may be the official pack itself: its channels-last vision_tower.* comes back as the
    base model's model.visual.* exactly, and only the pack's vision shard is downloaded."""
    out = tmp_path / "model"
    run = fetch("--out", str(out), "--vision-repo", REPO_OFFICIAL, "--no-embed-export")
    assert run.code == 0, run.out
    a = {k: v for k, v in tensors_of(full[0]).items() if k.startswith("model.visual.")}
    b = {k: v for k, v in tensors_of(out).items() if k.startswith("model.visual.")}
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert hub.requests_for(REPO_OFFICIAL, "model-00002-of-00002.safetensors")
    assert not hub.requests_for(REPO_OFFICIAL, "model-00001-of-00002.safetensors")
    assert json.loads((out / "config.json").read_text())["vision_config"] == \
        json.loads((full[0] / "config.json").read_text())["vision_config"]


def test_refuses_to_replace_a_foreign_directory(fetch, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("not a model")
    run = fetch("--out", str(out))
    assert run.code == 2 and "not written by bonsai-fetch" in run.out
    assert (out / "notes.txt").read_text() == "not a model"


def test_text_only_upload_is_renamed_and_made_multimodal(full, fetch, tmp_path):
    """An upload with a flat qwen3_5_text config and model.* names gets vLLM's multimodal names and config:
    the same directory as from the multimodal upload (its own MTP head aside)."""
    out = tmp_path / "model"
    run = fetch("--out", str(out), "--model-repo", REPO_TEXT_ONLY, "--hot-vocab", "64")
    assert run.code == 0, run.out
    a, b = tensors_of(full[0]), tensors_of(out)
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("mtp."))
    assert json.loads((out / "config.json").read_text()) == json.loads((full[0] / "config.json").read_text())
