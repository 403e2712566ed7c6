"""ternary/reference.py and ternary/quantize.py: the reference layer, the int8 prefill decomposition, quantization.

The dense references here are built from scipy's Hadamard matrix, not from the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from bonsai_vllm.ternary import reference as ternary
from bonsai_vllm.ternary.format import pack_ternary, unpack_ternary
from bonsai_vllm.ternary.quantize import dense_from_ternary, quantize_dense
from bonsai_vllm.ternary.reference import dequantize, int8_decompose, ternary_linear_int8_ref, ternary_linear_ref

G, B = 128, 1024  # group size, Hadamard block


def _blockdiag_h(width: int) -> torch.Tensor:
    """Dense float64 [width, width] block-diagonal normalized Hadamard (scipy), for references."""
    h = torch.from_numpy(scipy.linalg.hadamard(B).astype(np.float64) / np.sqrt(B))
    return torch.block_diag(*[h] * (width // B))


def _random_layer(out: int, width: int, seed: int):
    """Random ternary codes, positive fp16 group scales, signs: (codes int8, packed, scales, signs)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-1, 2, (out, width), generator=gen).to(torch.int8)
    scales = (0.01 + 0.04 * torch.rand(out, width // G, generator=gen)).to(torch.float16)
    signs = torch.randint(0, 2, (width,), generator=gen).float() * 2 - 1
    return codes, pack_ternary(codes), scales, signs


def test_dequantize_applies_each_group_scale():
    codes = torch.tensor([[1] * 128 + [-1] * 64 + [0] * 64], dtype=torch.int8)  # two groups
    scales = torch.tensor([[0.5, 2.0]], dtype=torch.float16)
    w = dequantize(pack_ternary(codes), scales, 128)
    assert w.dtype == torch.float32
    assert w[0, :128].tolist() == [0.5] * 128
    assert w[0, 128:192].tolist() == [-2.0] * 64 and w[0, 192:].tolist() == [0.0] * 64


def test_ternary_linear_ref_matches_dense_maths():
    """y = H(s ⊙ x) · W'^T + b, with H from scipy and W' = codes × scales written out by hand."""
    codes, packed, scales, signs = _random_layer(48, 2048, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 2048, generator=gen)
    bias = torch.randn(48, generator=gen)
    w_rot = codes.double() * scales.double().repeat_interleave(G, dim=1)
    want = (x.double() * signs.double()) @ _blockdiag_h(2048) @ w_rot.t() + bias.double()
    got = ternary_linear_ref(x, packed, scales, signs, G, B, bias=bias)
    assert got.shape == (2, 5, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert ternary_linear_ref(x.bfloat16(), packed, scales, signs, G, B).dtype == torch.bfloat16


def test_dense_from_ternary_is_the_same_layer():
    """x @ dense_from_ternary(...).T equals the ternary layer (float32 tolerance)."""
    codes, packed, scales, signs = _random_layer(64, 3072, seed=3)
    dense = dense_from_ternary(packed, scales, signs, G, B)
    assert dense.shape == (64, 3072) and dense.dtype == torch.float32
    x = torch.randn(7, 3072, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(x @ dense.t(), ternary_linear_ref(x, packed, scales, signs, G, B),
                               rtol=1e-4, atol=1e-4)
    # Independently: dense = W' · H · diag(s).
    w_rot = codes.double() * scales.double().repeat_interleave(G, dim=1)
    torch.testing.assert_close(dense.double(), w_rot @ _blockdiag_h(3072) * signs.double(), rtol=0, atol=1e-6)


def test_quantize_round_trip_is_exact():
    """A weight that is already code × scale in the rotated domain (zeros included) comes back exactly."""
    codes, packed, scales, signs = _random_layer(32, 2048, seed=5)
    assert (codes == 0).any(dim=1).all()  # every row has zeros: the scale refit is exercised
    dense = dense_from_ternary(packed, scales, signs, G, B)
    packed2, scales2 = quantize_dense(dense, signs, G, B)
    assert packed2.dtype == torch.int32 and scales2.dtype == torch.float16
    assert torch.equal(unpack_ternary(packed2), codes)
    assert torch.equal(scales2, scales)
    assert torch.equal(packed2, packed)


def test_quantize_is_absmean_ternary_with_least_squares_scale():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(16, 1024, generator=gen) * 0.02
    signs = torch.randint(0, 2, (1024,), generator=gen).float() * 2 - 1
    packed, scales = quantize_dense(w, signs, G, B)
    # Rotated domain via scipy's H: w' = (w ⊙ s) · H.
    w_rot = ((w.double() * signs.double()) @ _blockdiag_h(1024)).reshape(16, 8, G)
    t = w_rot.abs().mean(dim=-1, keepdim=True)
    want_codes = torch.round(torch.clamp(w_rot / t, -1, 1))
    codes = unpack_ternary(packed).reshape(16, 8, G).double()
    assert torch.equal(codes, want_codes)
    want_scale = (w_rot.abs() * codes.abs()).sum(-1) / codes.abs().sum(-1)
    torch.testing.assert_close(scales.double(), want_scale, rtol=1e-3, atol=0)  # fp16 rounding
    # The refit scale never does worse than the absmean t itself, and here strictly better.
    err_ours = ((codes * scales.double().unsqueeze(-1) - w_rot) ** 2).sum()
    err_absmean = ((codes * t - w_rot) ** 2).sum()
    assert err_ours < err_absmean
    # Ternary of a Gaussian: relative error about 0.46 (the cosine about 0.89).
    rel = (dense_from_ternary(packed, scales, signs, G, B) - w).norm() / w.norm()
    assert 0.40 < rel < 0.50


def test_quantize_zero_row_gives_zero_scale():
    w = torch.randn(4, 1024, generator=torch.Generator().manual_seed(7))
    w[2] = 0
    packed, scales = quantize_dense(w, torch.ones(1024), G, B)
    assert torch.all(scales[2] == 0) and torch.all(unpack_ternary(packed)[2] == 0)
    assert torch.isfinite(scales.float()).all() and torch.all(scales[[0, 1, 3]] > 0)


def test_quantize_errors():
    with pytest.raises(ValueError, match="multiple of the Hadamard block"):
        quantize_dense(torch.zeros(4, 1536), torch.ones(1536), G, B)
    with pytest.raises(ValueError, match=r"sign vector has shape \[1024\], expected \[2048\]"):
        quantize_dense(torch.zeros(4, 2048), torch.ones(1024), G, B)
    with pytest.raises(ValueError, match="not finite in fp16"):
        quantize_dense(torch.full((1, 1024), 1e6), torch.ones(1024), G, B)


# ------------------------------------------------------------------------------------------- int8


def test_int8_decompose_hand_example():
    # Scales 1.0, 0.5, 0.25 -> q = round(127 · s / 1.0) = 127, 64 (63.5 rounds to even), 32 (31.75).
    codes = torch.tensor([[1] * 128 + [-1] * 128 + [1] * 128,
                          [0] * 384], dtype=torch.int8)
    scales = torch.tensor([[1.0, 0.5, 0.25], [0.0, 0.0, 0.0]], dtype=torch.float16)
    w8, row_scale = int8_decompose(pack_ternary(codes), scales, G)
    assert w8.dtype == torch.int8 and row_scale.dtype == torch.float32
    assert w8[0, :128].unique().tolist() == [127]
    assert w8[0, 128:256].unique().tolist() == [-64]
    assert w8[0, 256:].unique().tolist() == [32]
    assert row_scale.tolist() == pytest.approx([1.0 / 127, 0.0])
    assert torch.all(w8[1] == 0)  # a zero row: no 0/0


def test_int8_path_error_is_within_the_rounding_bound():
    """Bound, per output (m, n), from the two roundings (activation a_m/2, weight smax_n/254 per weight):
        |y8 - y| <= smax_n/254 · Σ_k |xr_mk| + a_m/2 · Σ_k |W'_nk| + K · a_m/2 · smax_n/254
    where xr = H(s ⊙ x), a_m = max_k |xr_mk| / 127. On Gaussian activations the relative RMS error is
    about 0.9%, mostly from the per-token activation rounding; the test allows 1.5%."""
    codes, packed, scales, signs = _random_layer(96, 2048, seed=8)
    x = torch.randn(24, 2048, generator=torch.Generator().manual_seed(9))
    y = ternary_linear_ref(x, packed, scales, signs, G, B).double()
    w8, row_scale = int8_decompose(packed, scales, G)
    y8 = ternary_linear_int8_ref(x, w8, row_scale, signs, B).double()

    xr = (x.double() * signs.double()) @ _blockdiag_h(2048)  # [M, K]
    w_rot = codes.double() * scales.double().repeat_interleave(G, dim=1)  # [N, K]
    a = xr.abs().amax(dim=1, keepdim=True) / 127  # [M, 1]
    smax = scales.double().abs().amax(dim=1)  # [N]
    bound = (smax / 254 * xr.abs().sum(1, keepdim=True) + a / 2 * w_rot.abs().sum(1)
             + 2048 * a / 2 * smax / 254)
    slack = 1e-5 * (xr.abs() @ w_rot.abs().t())  # float32 rounding of both computations
    assert torch.all((y8 - y).abs() <= bound + slack)
    rel = (y8 - y).norm() / y.norm()
    assert rel < 0.015
    # ...and the bound is not vacuous: the error uses a real part of it.
    assert ((y8 - y).abs() / bound).max() > 0.02


def test_int8_matmul_fallback_is_bit_identical(monkeypatch):
    _, packed, scales, signs = _random_layer(40, 1024, seed=10)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(11))
    w8, row_scale = int8_decompose(packed, scales, G)
    y_int_mm = ternary_linear_int8_ref(x, w8, row_scale, signs, B)

    def refuse(a, b):
        raise RuntimeError("_int_mm refused this shape")

    monkeypatch.setattr(ternary.torch, "_int_mm", refuse)
    assert torch.equal(ternary_linear_int8_ref(x, w8, row_scale, signs, B), y_int_mm)


def test_int8_path_is_exact_when_nothing_needs_rounding():
    """Rotated activations already on the int8 grid (max 127 steps) and equal group scales (q = 127):
    both roundings are exact, so the int8 path must equal the float reference to float32 precision.
    Pins the grid: per-token step absmax/127, weight step smax/127."""
    gen = torch.Generator().manual_seed(12)
    codes = torch.randint(-1, 2, (32, 2048), generator=gen).to(torch.int8)
    scales = torch.full((32, 2048 // G), 0.03, dtype=torch.float16)
    signs = torch.randint(0, 2, (2048,), generator=gen).float() * 2 - 1
    steps = torch.randint(-127, 128, (5, 2048), generator=gen).double()
    steps[:, 0] = 127  # the absmax of every token is exactly 127 steps
    z = steps * torch.tensor([[0.01], [0.5], [1.0], [3.0], [1e-3]], dtype=torch.float64)  # xr wanted
    x = ((z @ _blockdiag_h(2048)) * signs.double()).float()  # x = s ⊙ H z, so H(s ⊙ x) = z
    packed = pack_ternary(codes)
    w8, row_scale = int8_decompose(packed, scales, G)
    assert w8.abs().max() == 127
    y8 = ternary_linear_int8_ref(x, w8, row_scale, signs, B)
    y = ternary_linear_ref(x, packed, scales, signs, G, B)
    torch.testing.assert_close(y8, y, rtol=1e-5, atol=1e-5 * y.abs().max().item())
