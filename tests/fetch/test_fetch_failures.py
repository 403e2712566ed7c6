"""bonsai-fetch when things go wrong: dropped connections, an outage, a signal, corrupt bytes, 401, 404, a full
disk, no network, a misfit MTP head. Each ends with its own message and exit status, and none leaves a
completion marker or a half-written model directory behind."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bonsai_fetch import build as build_mod
from bonsai_fetch.build import MARKER
from fetch_repos import REPO_BASE, REPO_MTP, REPO_OFFICIAL, REPO_OTHER_BASE, REPO_PRIVATE, REPO_VLLM, TOKEN

SHARDS = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"]
FAST = ("--vision-repo", "off", "--no-embed-export")  # the failure under test does not need them


CHUNK = 64 << 10


@pytest.fixture()
def small_chunks(monkeypatch):
    """huggingface_hub writes a transfer in 10 MiB chunks, so a cut loses up to 10 MiB; these shards are
    smaller than that, so make the chunks small enough to see where a transfer resumes."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)


def _untouched(out: Path) -> None:
    """A failed run leaves no model directory, no marker and no temporaries beside it."""
    assert not out.exists() and not (out / MARKER).exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial")]


def _store_dir(out: Path) -> Path:
    (snap,) = (out.parent / ".bonsai-fetch-cache" / REPO_VLLM.replace("/", "--")).iterdir()
    return snap


def test_connection_dropped_mid_file_resumes(tmp_path, fetch, hub, fixture_models, small_chunks):
    size = (fixture_models.upload / SHARDS[2]).stat().st_size
    cut = size // 2 // CHUNK * CHUNK
    hub.drop_once[(REPO_VLLM, SHARDS[2])] = cut
    run = fetch("--out", str(tmp_path / "model"), *FAST)
    assert run.code == 0, run.out
    first, second = hub.requests_for(REPO_VLLM, SHARDS[2])
    assert (first.range, first.status) == (None, 200)
    assert (second.range, second.status) == (f"bytes={cut}-", 206)  # only the rest was sent again
    for shard in SHARDS[:2]:
        assert len(hub.requests_for(REPO_VLLM, shard)) == 1


def test_outage_fails_cleanly_and_the_rerun_resumes(tmp_path, fetch, hub, fixture_models, small_chunks):
    out = tmp_path / "model"
    size = (fixture_models.upload / SHARDS[2]).stat().st_size
    cut = size // 3 // CHUNK * CHUNK
    hub.die_after[(REPO_VLLM, SHARDS[2])] = cut  # then the "network" stays down
    run = fetch("--out", str(out), *FAST)
    assert run.code == 3, run.out
    assert "no network" in run.out and "cannot reach" in run.out and "resumes" in run.out
    _untouched(out)
    part = _store_dir(out) / (SHARDS[2] + ".incomplete")
    assert part.stat().st_size == cut

    hub.revive()
    hub.log.clear()
    run = fetch("--out", str(out), *FAST)
    assert run.code == 0, run.out
    assert [r.range for r in hub.requests_for(REPO_VLLM, SHARDS[2])] == [f"bytes={cut}-"]
    assert not hub.requests_for(REPO_VLLM, SHARDS[0]) and not hub.requests_for(REPO_VLLM, SHARDS[1])
    assert (out / MARKER).is_file()


def test_sigterm_interrupts_cleanly(tmp_path, hub, fixture_models):
    """`docker stop` mid-download: exit 130, the message, nothing half-written; the partial file stays (what it
    holds depends on huggingface_hub's 10 MiB write chunks, so only its presence is checked)."""
    out = tmp_path / "model"
    hub.slow[(REPO_VLLM, SHARDS[0])] = 2 << 20  # 2 MB/s: long enough to be caught in the middle
    env = {**os.environ, "HF_ENDPOINT": hub.url, "BONSAI_FETCH_RETRIES": "0", "BONSAI_MTP_REPO": "off"}
    proc = subprocess.Popen([str(Path(sys.executable).parent / "bonsai-fetch"), "--no-progress", "--out", str(out),
                             *FAST], env=env, stderr=subprocess.PIPE, text=True)
    part = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        parts = list((tmp_path / ".bonsai-fetch-cache").rglob(SHARDS[0] + ".incomplete"))
        if parts:
            part = parts[0]
            time.sleep(0.5)  # well inside the transfer
            break
        time.sleep(0.1)
    assert part is not None, "the download never started"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "error (interrupted)" in err and "resumes on the next run" in err
    _untouched(out)
    assert part.exists() and not (part.parent / SHARDS[0]).exists()


def test_corrupted_download_is_detected(tmp_path, fetch, hub):
    out = tmp_path / "model"
    hub.corrupt.add((REPO_VLLM, SHARDS[1]))
    run = fetch("--out", str(out), *FAST)
    assert run.code == 7, run.out
    assert "checksum mismatch" in run.out and "sha256" in run.out
    _untouched(out)
    snap = _store_dir(out)
    assert not (snap / SHARDS[1]).exists() and not (snap / (SHARDS[1] + ".incomplete")).exists()


def test_verify_detects_a_changed_output_file(tmp_path, fetch, hub):
    out = tmp_path / "model"
    assert fetch("--out", str(out), *FAST).code == 0
    shard = out / SHARDS[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.unlink()  # a new inode: the cache's hard-linked copy stays intact
    shard.write_bytes(bytes(data))
    run = fetch("--out", str(out), *FAST, "--verify")
    assert run.code == 7 and SHARDS[1] in run.out and "--force" in run.out, run.out
    assert fetch("--out", str(out), *FAST, "--force").code == 0
    assert fetch("--out", str(out), *FAST, "--verify").code == 0


def test_401_without_or_with_a_wrong_token(tmp_path, fetch, hub):
    out = tmp_path / "model"
    run = fetch("--out", str(out), "--source", "vllm", "--model-repo", REPO_PRIVATE, *FAST)
    assert run.code == 4 and "not authorized" in run.out and "No token was sent" in run.out, run.out
    _untouched(out)
    run = fetch("--out", str(out), "--source", "vllm", "--model-repo", REPO_PRIVATE, *FAST,
                env={"HF_TOKEN": "hf_wrong"})
    assert run.code == 4 and "401" in run.out and "refused" in run.out, run.out
    _untouched(out)
    run = fetch("--out", str(out), "--source", "vllm", "--model-repo", REPO_PRIVATE, *FAST, env={"HF_TOKEN": TOKEN})
    assert run.code == 0, run.out


@pytest.mark.parametrize("args, words", [
    (("--source", "vllm", "--model-repo", "fraserprice/no-such-repo"), "repository does not exist"),
    (("--model-revision", "v9.9"), "revision does not exist"),
    (("--mtp-repo", REPO_MTP, "--mtp-file", "mtp-v2.safetensors"), "'mtp-v2.safetensors' is not in"),
])
def test_404_names_what_is_missing(tmp_path, fetch, hub, args, words):
    out = tmp_path / "model"
    run = fetch("--out", str(out), *FAST, *args, env={"HF_TOKEN": TOKEN})  # with a token the Hub says 404
    assert run.code == 5 and "not found" in run.out and words in run.out, run.out
    _untouched(out)
    assert not [r for r in hub.resolve_gets() if r.path.endswith(".safetensors")]


def test_short_disk_stops_before_downloading(tmp_path, fetch, hub):
    out = tmp_path / "model"
    run = fetch("--out", str(out), env={"BONSAI_FETCH_FREE_BYTES": str(10 << 20)})
    assert run.code == 6 and "not enough free disk" in run.out and "10.5 MB is free" in run.out, run.out
    _untouched(out)
    assert not [r for r in hub.resolve_gets() if r.path.endswith(".safetensors")]  # nothing large came down


def test_disk_filling_up_while_writing(tmp_path, fetch, hub, monkeypatch):
    def full_disk(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(build_mod.st, "write", full_disk)
    out = tmp_path / "model"
    run = fetch("--out", str(out), *FAST)
    assert run.code == 6 and "disk filled up" in run.out, run.out
    _untouched(out)


def test_no_network(tmp_path, fetch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "model"
    start = time.monotonic()
    run = fetch("--out", str(out), env={"HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert run.code == 3 and "cannot reach" in run.out, run.out
    assert time.monotonic() - start < 30
    _untouched(out)


def test_offline_rerun_keeps_the_complete_output(tmp_path, fetch, hub):
    out = tmp_path / "model"
    assert fetch("--out", str(out), *FAST).code == 0
    hub.dead = True  # a container restart without network must still start the server
    run = fetch("--out", str(out), *FAST)
    assert run.code == 0 and "could not be asked" in run.out and "up to date" in run.out, run.out


def test_misfit_mtp_head_is_refused(tmp_path, fetch, hub):
    out = tmp_path / "model"
    run = fetch("--out", str(out), *FAST, "--mtp-repo", REPO_MTP, "--mtp-file", "mtp-misfit.safetensors")
    assert run.code == 8 and "mtp.fc.weight" in run.out and "BONSAI_MTP_REPO=off" in run.out, run.out
    _untouched(out)


def test_vision_tower_of_another_model_is_refused(tmp_path, fetch, hub):
    # Qwen3.5-27B's tower fits Ternary-Bonsai-2-27B (a ternary Qwen3.8-27B) shape for shape: only the model
    # cards tell them apart. The old default took it without a word.
    out = tmp_path / "model"
    run = fetch("--out", str(out), "--no-embed-export", "--vision-repo", REPO_OTHER_BASE)
    assert run.code == 8, run.out
    assert REPO_OTHER_BASE in run.out and REPO_BASE in run.out and "BONSAI_VISION_CHECK=0" in run.out
    _untouched(out)
    # asked for explicitly, it is taken
    run = fetch("--out", str(out), "--no-embed-export", "--vision-repo", REPO_OTHER_BASE, "--vision-check", "0")
    assert run.code == 0, run.out


def test_default_vision_tower_is_the_models_own():
    from bonsai_fetch.cli import DEFAULT_OFFICIAL_REPO, DEFAULT_VISION_REPO

    assert DEFAULT_VISION_REPO == REPO_BASE and DEFAULT_OFFICIAL_REPO == REPO_OFFICIAL


@pytest.mark.parametrize("card, bases", [
    ("---\nbase_model: Qwen/Qwen3.8-27B\n---\n", ["Qwen/Qwen3.8-27B"]),
    ("---\nlicense: mit\nbase_model:\n  - a/b\n  - 'c/d'\ntags: [x]\n---\nbase_model: not/this\n", ["a/b", "c/d"]),
    ("# no front matter\nbase_model: x/y\n", []),
])
def test_model_card_base_models(card, bases):
    from bonsai_fetch.build import card_base_models

    assert card_base_models(card) == bases


def test_bad_option_values(tmp_path, fetch):
    run = fetch("--out", str(tmp_path / "m"), env={"BONSAI_SOURCE": "somewhere"})
    assert run.code == 2 and "BONSAI_SOURCE" in run.out
    run = fetch("--out", str(tmp_path / "m"), "--token-counts", str(tmp_path / "none.json"))
    assert run.code == 2 and "token-count file" in run.out


def test_manifest_records_the_request(tmp_path, fetch, hub):
    out = tmp_path / "model"
    assert fetch("--out", str(out), *FAST).code == 0
    manifest = json.loads((out / build_mod.MANIFEST).read_text())
    assert manifest["request"]["vision"] is None and manifest["request"]["embed"] is None
    assert manifest["sources"]["weights"]["revision"] == "main"


def test_empty_settings_mean_defaults_and_model_dir_is_shared():
    """compose passes `NAME=` lines of .env as empty strings: they must count as unset. Without a setting of
    its own, bonsai-fetch writes where the vLLM service looks (MODEL_DIR)."""
    from bonsai_fetch.cli import DEFAULT_MODEL_REPO, DEFAULT_VISION_REPO, build_parser, options_from

    empty = {name: "" for name in ("BONSAI_MODEL_DIR", "BONSAI_MODEL_REVISION", "BONSAI_VISION_REPO", "BONSAI_MTP_REPO",
                                   "BONSAI_EMBED_EXPORT", "BONSAI_EMBED_HOT_VOCAB", "BONSAI_EMBED_TOKEN_COUNTS",
                                   "BONSAI_FETCH_CACHE", "HF_TOKEN", "HF_ENDPOINT", "BONSAI_MODEL_REPO")}
    opts = options_from(build_parser().parse_args([]), {**empty, "MODEL_DIR": "/srv/models/bonsai"})
    assert opts.out == Path("/srv/models/bonsai") and opts.model_repo == DEFAULT_MODEL_REPO
    assert opts.model_revision == "main" and opts.vision_repo == DEFAULT_VISION_REPO and opts.mtp_repo is None
    assert opts.embed_export and opts.hot_vocab == 32000 and opts.token is None and opts.cache_dir is None
    assert opts.endpoint == "https://huggingface.co"
    opts = options_from(build_parser().parse_args(["--vision-repo", "off"]), {"BONSAI_MODEL_DIR": "/x"})
    assert opts.out == Path("/x") and opts.vision_repo is None
