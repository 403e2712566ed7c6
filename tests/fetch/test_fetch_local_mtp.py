"""BONSAI_MTP_REPO as a local folder (where bonsai-mtp-train wrote mtp.safetensors): the swap takes the
file without asking the Hub for it, and a head that does not fit is refused leaving the model untouched."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file


def test_local_folder_head_is_swapped_in(tmp_path, fetch, hub, fixture_models):
    out = tmp_path / "model"
    assert fetch("--out", str(out), "--hot-vocab", "16").code == 0
    own = load_file(out / "mtp.safetensors")

    hub.log.clear()
    run = fetch("--out", str(out), "--hot-vocab", "16", "--mtp-repo", str(fixture_models.mtp_dir))
    assert run.code == 0 and "built mtp" in run.out, run.out
    got = load_file(out / "mtp.safetensors")
    ja = fixture_models.mtp_ja()
    assert all(torch.equal(got[k], v) for k, v in ja.items()) and not torch.equal(got["mtp.fc.weight"],
                                                                                    own["mtp.fc.weight"])
    assert hub.resolve_gets() == []  # the head came from the folder, nothing was downloaded

    # A head of another shape: refused with the reason, the served head stays the one just swapped in.
    bad = tmp_path / "bad-head"
    bad.mkdir()
    wrong = dict(ja)
    wrong["mtp.fc.weight"] = wrong["mtp.fc.weight"][:, :16].contiguous()
    save_file(wrong, str(bad / "mtp.safetensors"))
    run = fetch("--out", str(out), "--hot-vocab", "16", "--mtp-repo", str(bad))
    assert run.code != 0 and "mtp.fc.weight" in run.out and "BONSAI_MTP_REPO=off" in run.out, run.out
    assert torch.equal(load_file(out / "mtp.safetensors")["mtp.fc.weight"], ja["mtp.fc.weight"])
