"""kv/calibration.py: samples recorded per rank, joined into the model's heads, fitted into the rotation
file that the vLLM backend reads (KVRotation.from_file with a rank's head slice). The served round trip
(record in a running vLLM, calibrate, serve with the file) is in tests/kv/test_k3v2_served.py."""

from __future__ import annotations

import pytest
import torch

from bonsai_vllm.kv import calibration as cal
from bonsai_vllm.kv.rotation import KVRotation

D = 64


def _anisotropic(gen: torch.Generator, n: int, heads: int) -> torch.Tensor:
    scales = torch.logspace(1.5, -1, D)
    basis = torch.linalg.qr(torch.randn(D, D, generator=gen))[0]
    return (torch.randn(n, heads, D, generator=gen) * scales) @ basis.T


def _record(tmp_path, rank: int, q, k, v, tokens: int, step: int = 50) -> cal.SampleRecorder:
    rec = cal.SampleRecorder(tmp_path, rank, tokens)
    for a in range(0, q.shape[0], step):  # steps of several sizes, as an engine's batches come
        rec.add(3, q[a:a + step], k[a:a + step], v[a:a + step])
    return rec


def test_recorder_keeps_the_first_tokens_and_writes_once(tmp_path):
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(300, 6, D, generator=gen), torch.randn(300, 2, D, generator=gen), torch.randn(300, 2, D, generator=gen)
    rec = cal.SampleRecorder(tmp_path, 0, 120)
    rec.add(3, q[:50], k[:50], v[:50])
    assert not rec.path(3).exists()  # not enough tokens yet: nothing under the final name
    rec.add(3, q[50:200], k[50:200], v[50:200])
    assert rec.path(3).exists() and 3 in rec.done
    mtime = rec.path(3).stat().st_mtime_ns
    rec.add(3, q[200:], k[200:], v[200:])  # done: later tokens are ignored, the file is not rewritten
    assert rec.path(3).stat().st_mtime_ns == mtime
    (qs, ks, vs), = cal.load_samples(tmp_path).values()
    assert torch.equal(qs, q[:120]) and torch.equal(ks, k[:120]) and torch.equal(vs, v[:120])
    assert not list(tmp_path.glob("*.partial"))


def test_ranks_are_joined_in_head_order_and_the_file_gives_each_rank_its_heads(tmp_path):
    gen = torch.Generator().manual_seed(1)
    n = 400
    k = _anisotropic(gen, n, 4)  # the model's 4 KV heads: rank 0 holds heads 0-1, rank 1 heads 2-3
    v = torch.randn(n, 4, D, generator=gen)
    q = torch.randn(n, 24, D, generator=gen)
    samples = tmp_path / "capture"
    _record(samples, 1, q[:, 12:], k[:, 2:], v[:, 2:], n)  # rank 1 finishes first: order must not matter
    _record(samples, 0, q[:, :12], k[:, :2], v[:, :2], n)
    (qs, ks, vs), = cal.load_samples(samples).values()
    assert torch.equal(ks, k) and torch.equal(vs, v) and torch.equal(qs, q)

    out = tmp_path / "rot.safetensors"
    assert cal.main([str(samples), str(out)]) == 0
    full = KVRotation.from_file(out, 3, 4)
    want = cal.calibrate(k, v, q)
    assert torch.allclose(full.rk, want.rk) and torch.allclose(full.rv, want.rv)
    rank1 = KVRotation.from_file(out, 3, 2, head_offset=2)
    assert torch.equal(rank1.rk, full.rk[2:]) and torch.equal(rank1.rv, full.rv[2:])
    assert not torch.allclose(rank1.rk, full.rk[:2])  # per-head rotations really differ
    # what the file buys on these anisotropic keys (also printed by the CLI)
    had = KVRotation.randomized_hadamard(3, 4, D)
    assert cal.quantization_error(k, full.rk, 3, 0.96) < cal.quantization_error(k, had.rk, 3, 0.96)


def test_file_errors_name_what_is_wrong(tmp_path, capsys):
    assert cal.main([str(tmp_path), str(tmp_path / "out.safetensors")]) == 2
    assert "BONSAI_KV_CAPTURE" in capsys.readouterr().err
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 2, D, generator=gen)
    _record(tmp_path, 1, torch.randn(64, 12, D, generator=gen), x, x, 64)  # rank 0's file missing
    with pytest.raises(ValueError, match="ranks \\[1\\]"):
        cal.load_samples(tmp_path)
    _record(tmp_path, 0, torch.randn(64, 12, D, generator=gen), x, x, 64)
    out = tmp_path / "rot.safetensors"
    assert cal.main([str(tmp_path), str(out), "--no-query-metric"]) == 0
    with pytest.raises(ValueError, match="has no layers.5.k"):
        KVRotation.from_file(out, 5, 2)
    with pytest.raises(ValueError, match="does not fit KV heads 4..5"):
        KVRotation.from_file(out, 3, 2, head_offset=4)
