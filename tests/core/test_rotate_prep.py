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
