"""The CUDA C rotation + prep of decode rows (ternary/kernels/rotate_prep.py, rotate_prep.cu) where no GPU is: its
reference, the checks before a launch, and the switch in linear.prepare.

The kernel runs only on CUDA: `make gpu-check` compares it bit for bit with `rotate_prep_reference` at the 27B's
widths and 1-64 rows, and checks every layer through ternary_linear with it; tests/core/test_compile_check.py
compiles its served instances with NVRTC for sm_90 and sm_120. Here: that reference is what it claims (the
butterflies are the Hadamard rotation; the prep of them is dp4a's prep of the rotated rows, up to the rotation's
float32 rounding).
"""

from __future__ import annotations

import math
import types

import pytest
import torch


@pytest.fixture
def kern():
    # imported when a test runs (the kernel test modules switch Triton's interpreter on first)
    from bonsai_vllm.ternary import reference
    from bonsai_vllm.ternary.kernels import dp4a, linear, rotate_prep

    return types.SimpleNamespace(rp=rotate_prep, dp4a=dp4a, linear=linear, ref=reference)


def _signs(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (k,), generator=g).float() * 2 - 1


@pytest.mark.parametrize("block", [256, 512, 1024])
def test_butterflies_are_the_signed_block_hadamard(block, kern):
    k = 2 * block
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(block))
    signs = _signs(k, block)
    got = kern.rp.butterflies_reference(x, signs, block)
    want = kern.ref.signed_block_hadamard(x, signs, block)
    assert (got - want).norm() / want.norm() < 1e-6
    # small integers: every sum is exact, so both ways agree to the bit before the norm's rounding
    xi = torch.randint(-8, 9, (2, k), generator=torch.Generator().manual_seed(1)).float()
    got = kern.rp.butterflies_reference(xi, signs, block) * math.sqrt(block)
    want = kern.ref.signed_block_hadamard(xi, signs, block) * math.sqrt(block)
    assert torch.equal(got.round(), want.round()) and (got - got.round()).abs().max() < 1e-3


def _unplanar(p: torch.Tensor) -> torch.Tensor:
    """[4, K/16] int32 planar bytes (one row) -> int8 values [K] in input order."""
    kw = p.shape[1]
    return p.t().contiguous().view(torch.int8).view(kw, 4, 4).transpose(1, 2).reshape(-1)


@pytest.mark.parametrize("k,block", [(5120, 1024), (3072, 1024), (8704, 512)])
def test_reference_prepares_the_rotated_rows(k, block, kern):
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    signs = _signs(k, 3)
    got = kern.rp.rotate_prep_reference(x, signs, block)
    xr = kern.ref.signed_block_hadamard(x.float(), signs, block)
    want = kern.dp4a.prepare_reference(xr)
    assert got.rows == 2 and got.xa.shape == want.xa.shape and got.s.shape == want.s.shape
    for i in range(2):
        x8 = _unplanar(got.xa[i])
        # the bytes are dp4a's prep of the rotated row except where the two rotations' float32 rounding put an
        # input on the other side of an int8 rounding boundary
        assert (x8 == _unplanar(want.xa[i])).float().mean().item() > 0.999
        assert torch.allclose(got.s[i, 0], want.s[i, 0], rtol=1e-5, atol=0)
        rebuilt = got.s[i, 0].repeat_interleave(128) * x8.float() + got.s[i, 1].repeat_interleave(128) * _unplanar(
            got.xr[i]).float()
        assert (rebuilt - xr[i]).norm() / xr[i].norm() < 1e-4


def test_refuses_what_the_kernel_cannot_take(kern):
    x = torch.zeros(2, 3072, dtype=torch.bfloat16)
    signs = torch.ones(3072)
    with pytest.raises(ValueError, match="whole blocks"):
        kern.rp.rotate_prep(x, signs, 2048)
    with pytest.raises(ValueError, match="whole blocks"):
        kern.rp.rotate_prep(torch.zeros(2, 3000, dtype=torch.bfloat16), torch.ones(3000), 1024)
    with pytest.raises(ValueError, match="signs"):
        kern.rp.rotate_prep(x, signs.half(), 1024)
    with pytest.raises(ValueError, match="x of"):
        kern.rp.rotate_prep(x.to(torch.int8), signs, 1024)
    with pytest.raises(ValueError, match="rows per CTA"):
        kern.rp.rotate_prep(x, signs, 1024, rows_per_cta=3)


def test_template_names_the_instance(kern):
    assert kern.rp.template(1024, 2, torch.bfloat16) == "rotate_prep<1024, 2, 1>"
    assert kern.rp.template(512, 1, torch.float32) == "rotate_prep<512, 1, 0>"
    # what the launch multiplies by: 1/sqrt(block) rounded to float32, as hadamard's Triton kernels do
    bits = kern.rp._norm_bits(512)
    assert torch.tensor([bits], dtype=torch.int32).view(torch.float32).item() == pytest.approx(512 ** -0.5, rel=1e-7)
    assert torch.tensor([kern.rp._norm_bits(1024)], dtype=torch.int32).view(torch.float32).item() == 1 / 32


def test_not_on_cpu_nor_before_sm90(kern, monkeypatch):
    assert not kern.rp.applies("cpu", 1024)
    monkeypatch.setattr(kern.rp.nvrtc, "capability", lambda index: (8, 9))
    assert not kern.rp.applies("cuda:0", 1024)
    monkeypatch.setattr(kern.rp.nvrtc, "capability", lambda index: (12, 0))
    assert kern.rp.applies("cuda:0", 1024) and not kern.rp.applies("cuda:0", 128)


def test_prepare_leaves_the_switch_off_where_the_kernel_cannot_run(kern):
    from bonsai_vllm.ternary.format import pack_ternary

    codes = torch.randint(-1, 2, (32, 1024), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    tw = kern.linear.prepare(pack_ternary(codes), torch.ones(32, 8, dtype=torch.float16), _signs(1024, 0),
                             cuda_rotation=True)
    assert tw.cuda_rotation is False  # CPU: the Triton rotation (or the reference route) stays


# ------------------------------------------------------------------ the residual add + RMSNorm fused ahead


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("add", [True, False])
def test_norm_reference_is_vllms_norm_up_to_one_rounding(dtype, add, kern):
    # linear.rms_norm is vLLM's formula in torch (tests/test_linear_adapter.py holds it to vLLM's own module)
    g = torch.Generator().manual_seed(7)
    k = 5120
    x = torch.randn(6, k, generator=g).to(dtype)
    residual = (4 * torch.randn(6, k, generator=g)).to(dtype) if add else None
    weight = (0.1 * torch.randn(k, generator=g)).to(dtype)  # Gemma-style: the norm multiplies by 1 + weight
    normed, new_res = kern.rp.norm_reference(x, residual, weight, 1e-6, weight_offset=1.0)
    want, want_res = kern.linear.rms_norm(x, residual, weight, 1e-6, weight_offset=1.0)
    assert normed.dtype == dtype and normed.shape == x.shape
    if add:
        assert torch.equal(new_res, want_res)  # the residual is one rounding of an exact float32 sum
    else:
        assert new_res is None
    # the sum of squares in another order: the normed rows may differ by one unit in the last place, rarely
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    rel = (normed.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
    assert rel.max().item() <= ulp
    assert (normed != want).float().mean().item() < 0.02


def test_norm_reference_sums_in_the_kernels_order(kern):
    # inputs whose squares do not add exactly in float32: the kernel's order (eight per thread, warp butterflies,
    # warps in turn) gives a different total from a plain left-to-right sum, and the reference must follow it
    k = 1024
    x = torch.full((1, k), 0.6 ** 0.5)  # squares of 0.6 added one by one to 9e6 (ulp 1) round up to 1 each
    x[0, 0] = 3000.0
    weight = torch.ones(k)
    normed, _ = kern.rp.norm_reference(x, None, weight, 0.0)
    sq = x[0] * x[0]
    parts = sq.reshape(k // 8, 8)
    per_thread = torch.zeros(k // 8)
    for i in range(8):
        per_thread = per_thread + parts[:, i]
    lanes = per_thread.reshape(k // 256, 32)
    for d in (1, 2, 4, 8, 16):
        lanes = lanes + lanes[:, torch.arange(32) ^ d]
    total = torch.zeros(())
    for w in range(k // 256):
        total = total + lanes[w, 0]
    rstd = 1.0 / torch.sqrt(total / k)
    assert torch.equal(normed[0], x[0] * rstd)
    serial = torch.zeros(())
    for v in sq:
        serial = serial + v
    assert serial.item() != total.item()  # the order matters for these inputs


def test_norm_prep_reference_prepares_what_it_stores(kern):
    g = torch.Generator().manual_seed(3)
    k = 5120
    x = torch.randn(3, k, generator=g).bfloat16()
    residual = torch.randn(3, k, generator=g).bfloat16()
    weight, signs = (0.1 * torch.randn(k, generator=g)).bfloat16(), _signs(k, 5)
    normed, new_res, act = kern.rp.norm_rotate_prep_reference(x, residual, weight, 1e-6, signs, 1024, 1.0)
    want = kern.rp.rotate_prep_reference(normed, signs, 1024)
    for f in ("xa", "xr", "gx", "gr", "s"):
        assert torch.equal(getattr(act, f), getattr(want, f))
    assert torch.equal(new_res, (x.float() + residual.float()).bfloat16())


def test_norm_prep_refuses_what_the_kernel_cannot_take(kern):
    k = 5120
    bf16 = torch.bfloat16
    x = torch.zeros(2, k, dtype=bf16)
    w, signs = torch.ones(k, dtype=bf16), torch.ones(k)
    with pytest.raises(ValueError, match="whole blocks"):
        kern.rp.norm_rotate_prep(torch.zeros(2, 3000, dtype=bf16), None, torch.ones(3000, dtype=bf16), 1e-6,
                                 torch.ones(3000))
    with pytest.raises(ValueError, match="up to 8192"):
        kern.rp.norm_rotate_prep(torch.zeros(2, 9216, dtype=bf16), None, torch.ones(9216, dtype=bf16), 1e-6,
                                 torch.ones(9216))
    with pytest.raises(ValueError, match="residual"):
        kern.rp.norm_rotate_prep(x, torch.zeros(2, k, dtype=torch.float16), w, 1e-6, signs)
    with pytest.raises(ValueError, match="weight"):
        kern.rp.norm_rotate_prep(x, None, w.float(), 1e-6, signs)
    with pytest.raises(ValueError, match="signs"):
        kern.rp.norm_rotate_prep(x, None, w, 1e-6, signs[:1024])
    # with the prep, each block's CTA reads the whole row: the new residual cannot overwrite x or the residual
    residual = torch.zeros(2, k, dtype=bf16)
    for out in (residual, x):
        with pytest.raises(ValueError, match="must not overlap"):
            kern.rp.norm_rotate_prep(x, residual, w, 1e-6, signs, residual_out=out)


def test_norm_template_and_where_it_applies(kern, monkeypatch):
    assert kern.rp.norm_template(1024, 5120, torch.bfloat16, True) == "norm_rotate_prep<1024, 5, 1, 1, 1>"
    assert kern.rp.norm_template(1024, 2048, torch.float16, False, False) == "norm_rotate_prep<1024, 2, 2, 0, 0>"
    assert not kern.rp.norm_applies("cpu", 5120, 1024)
    monkeypatch.setattr(kern.rp.nvrtc, "capability", lambda index: (9, 0))
    assert kern.rp.norm_applies("cuda:0", 5120, 1024)
    assert not kern.rp.norm_applies("cuda:0", 9216, 1024)  # a row is one CTA of K / 8 threads
    assert not kern.rp.norm_applies("cuda:0", 5120, 4096)
