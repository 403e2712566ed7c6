"""ternary.kernels.dp4a (issue 19's M = 1 candidate) against its torch references, on CPU through Triton's
interpreter (dp4a emulated there), and compiled with real PTX dp4a when a GPU is present.

- prepare (one launch) gives the same planar bytes, group sums and scales as prepare_reference, bit for bit;
- hadamard.rotate_dp4a (rotation and prep in one launch) gives prepare_reference of the rotated row, up to
  the rotation's float32 rounding;
- the GEMV equals the integer maths of gemv_reference and is close to the float32 layer (dequantize);
- split-K ends deterministically: the same bits on every call (the tile counters reset themselves), for
  uneven slice counts too, and close to the unsplit result.
The real shapes, timings and compiled dp4a: benchmarks/dp4a_gemv.py on the GPU (docs/benchmarks.md).
"""

from __future__ import annotations

import interpreter_scope
import torch

GPU = torch.cuda.is_available()
if not GPU:  # before the kernel module is imported: @triton.jit then decorates interpreted functions
    interpreter_scope.enable()

import pytest  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed")

from bonsai_vllm.ternary.format import pack_ternary  # noqa: E402
from bonsai_vllm.ternary.kernels import dp4a  # noqa: E402
from bonsai_vllm.ternary.reference import dequantize  # noqa: E402

# hadamard holds the rotation kernel that prepares for dp4a (and imports dp4a's group prep)
_interpreter = interpreter_scope.module_fixture([f"bonsai_vllm.ternary.kernels.{m}" for m in ("dp4a", "hadamard")])

DEV = "cuda" if GPU else "cpu"


def layer(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)
    scales = (0.01 + 0.04 * torch.rand(n, k // 128, generator=g)).to(torch.float16)
    return pack_ternary(codes).to(DEV), scales.to(DEV)


def activation(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(k, generator=g)
    x[7] = 9.0  # an outlier: most of x8 is small, so the residual's share matters
    return x.to(torch.bfloat16).to(DEV)


def rows_of(m: int, k: int, seed: int) -> torch.Tensor:
    """m activation rows [m, K], each with its own outlier."""
    return torch.stack([activation(k, seed=seed + i) for i in range(m)])


@pytest.mark.parametrize("k,m", [(384, 1), (1024, 1), (1024, 3)])  # K not a power of two, and one that is
def test_prepare_matches_its_reference_bit_for_bit(k, m):
    x = rows_of(m, k, seed=k)
    want = dp4a.prepare_reference(x)
    got = dp4a.prepare(x)
    assert got.rows == m and got.xa.shape == (m, 4, k // 16) and got.s.shape == (m, 2, k // 128)
    for name in ("xa", "xr", "gx", "gr"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name).cpu()), name
    assert torch.allclose(got.s.cpu(), want.s.cpu(), rtol=1e-6, atol=0)
    # a row alone gives the same as among others (no state across rows)
    assert torch.equal(dp4a.prepare(x[m - 1]).xa.cpu()[0], got.xa.cpu()[m - 1])
    assert (got.prep, got.prep_rows) == (dp4a.PREP_DP4A, 1)  # what the mma kernel's launch rule reads


@pytest.mark.parametrize("bm,m", [(2, 3), (4, 5)])
def test_rotate_dp4a_rows_per_program_give_the_same_bits(bm, m):
    # several rows per program (the last one part empty): the same maths per group, so the same bits as one row
    # per program, and nothing written past row M
    from bonsai_vllm.ternary.kernels.hadamard import rotate_dp4a

    k = 2048
    x = rows_of(m, k, seed=bm)
    signs = (torch.randint(0, 2, (k,), generator=torch.Generator().manual_seed(2)).float() * 2 - 1).to(DEV)
    want = rotate_dp4a(x, signs, 1024, bm=1)
    assert (want.prep, want.prep_rows) == (dp4a.PREP_ROTATION, 1)
    out = dp4a.empty_activations(k, x.device, m + 1)
    for t in (out.xa, out.xr, out.gx, out.gr):
        t.fill_(-7)
    out.s.fill_(float("nan"))
    got = rotate_dp4a(x, signs, 1024, bm=bm, out=dp4a.Dp4aActivations(*(t[:m] for t in (out.xa, out.xr, out.gx,
                                                                                         out.gr, out.s))))
    # the buffers it was handed, marked with the kernel and rows per program that wrote them
    assert (got.prep, got.prep_rows) == (dp4a.PREP_ROTATION, bm) and got.xa.data_ptr() == out.xa.data_ptr()
    for name in ("xa", "xr", "gx", "gr", "s"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name).cpu()), name
        assert torch.all(getattr(out, name)[m].cpu().float().isnan() | (getattr(out, name)[m].cpu() == -7)), name


def _unplanar(p: torch.Tensor) -> torch.Tensor:
    """[4, K/16] int32 planar bytes (one row) -> int8 values [K] in input order (Dp4aActivations' layout)."""
    kw = p.shape[1]
    return p.t().contiguous().view(torch.int8).view(kw, 4, 4).transpose(1, 2).reshape(-1)


@pytest.mark.parametrize("k,block,m", [(3072, 1024, 1), (1024, 256, 1), (2048, 1024, 2)])
def test_rotate_dp4a_prepares_the_rotated_rows(k, block, m):
    from bonsai_vllm.ternary.kernels.hadamard import rotate_dp4a
    from bonsai_vllm.ternary.reference import signed_block_hadamard

    x = rows_of(m, k, seed=k + block)
    signs = (torch.randint(0, 2, (k,), generator=torch.Generator().manual_seed(1)).float() * 2 - 1).to(DEV)
    xr = signed_block_hadamard(x.float(), signs, block)  # float32 [M, K]
    want = dp4a.prepare_reference(xr)
    got = rotate_dp4a(x, signs, block)
    assert got.rows == m
    for i in range(m):
        x8, r8 = _unplanar(got.xa.cpu()[i]), _unplanar(got.xr.cpu()[i])
        # The bytes are the reference's except where the rotation's float32 rounding moved an input across a
        # rounding boundary of its int8 (x8 one step off, the residual then off by about 127 of its steps).
        same = (x8 == _unplanar(want.xa.cpu()[i])).float().mean().item()
        assert same > 0.995, same
        s_got, s_want = got.s.cpu()[i], want.s.cpu()[i]
        assert torch.allclose(s_got[0], s_want[0], rtol=1e-5, atol=0)  # s1: from the group's max
        assert torch.allclose(s_got[1], s_want[1], rtol=0.05, atol=0)  # s2: the residual's, moved by those
        # Whatever the bytes, they are consistent: the group sums are theirs, and they rebuild the rotated row
        # to the residual's resolution.
        assert torch.equal(got.gx.cpu()[i], x8.view(-1, 128).sum(1, dtype=torch.int32))
        assert torch.equal(got.gr.cpu()[i], r8.view(-1, 128).sum(1, dtype=torch.int32))
        rebuilt = s_got[0].repeat_interleave(128) * x8.float() + s_got[1].repeat_interleave(128) * r8.float()
        assert (rebuilt - xr[i].cpu()).norm() / xr[i].norm() < 1e-4


@pytest.mark.parametrize("m", [1, 2, 4])
def test_gemv_equals_the_integer_maths_and_is_close_to_the_float_layer(m):
    n, k = 48, 1024
    packed, scales = layer(n, k, seed=3)
    x = rows_of(m, k, seed=4)
    act = dp4a.prepare(x)
    ws = dp4a.Dp4aWorkspace(DEV)
    y = dp4a.gemv(act, packed, scales, dp4a.Dp4aConfig(bn=16, bw=16, warps=2, stages=1), ws,
                  out=torch.full((m, n), float("nan"), device=DEV))
    assert y.shape == (m, n) and torch.isfinite(y).all()
    exact = dp4a.gemv_reference(act, packed, scales)
    assert torch.allclose(y, exact, rtol=1e-5, atol=1e-6)
    want = x.float() @ dequantize(packed, scales, 128).float().t()
    assert (y - want).norm() / want.norm() < 1e-4  # int8 + int8 residual: far under bf16's 4e-3
    # each row is its own: the same as that row alone
    alone = dp4a.gemv(dp4a.prepare(x[m - 1]), packed, scales, dp4a.Dp4aConfig(bn=16, bw=16, warps=2, stages=1), ws)
    assert torch.allclose(alone[0], y[m - 1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("split,m", [(2, 1), (3, 1), (8, 1), (3, 3)])  # 3: slices of unequal length; 8: one step each
def test_split_k_is_deterministic_and_agrees_with_one_slice(split, m):
    n, k = 40, 1024  # 40 rows: the last row tile is partial
    packed, scales = layer(n, k, seed=5)
    act = dp4a.prepare(rows_of(m, k, seed=6))
    ws = dp4a.Dp4aWorkspace(DEV)
    one = dp4a.gemv(act, packed, scales, dp4a.Dp4aConfig(bn=16, bw=8, warps=1, stages=1), ws)
    cfg = dp4a.Dp4aConfig(bn=16, bw=8, warps=1, stages=1, split=split)
    first = dp4a.gemv(act, packed, scales, cfg, ws, out=torch.full((m, n), float("nan"), device=DEV))
    assert torch.isfinite(first).all(), "a row tile was never written: its last slice did not add up"
    assert torch.count_nonzero(ws.counters) == 0, "the tile counters were not reset"
    for _ in range(3):
        again = dp4a.gemv(act, packed, scales, cfg, ws, out=torch.full((m, n), float("nan"), device=DEV))
        assert torch.equal(again, first)
    assert torch.allclose(first, one, rtol=1e-5, atol=1e-6)


def test_prepare_refuses_a_k_outside_the_scale_groups_and_gemv_too_many_rows():
    with pytest.raises(ValueError, match="multiple of the scale group 128"):
        dp4a.prepare(torch.zeros(200, device=DEV))
    packed, scales = layer(16, 512, seed=1)
    act = dp4a.prepare(rows_of(dp4a.MAX_ROWS + 1, 512, seed=2))
    with pytest.raises(ValueError, match="rows; the kernel takes 1 to"):
        dp4a.gemv(act, packed, scales, dp4a.Dp4aConfig(bn=16, bw=16, warps=1, stages=1), dp4a.Dp4aWorkspace(DEV))


@pytest.mark.parametrize("max_m", [1, 3])
def test_the_route_takes_dp4a_for_decode_rows_only_when_switched_on(monkeypatch, max_m):
    from bonsai_vllm.ternary.kernels import linear
    from bonsai_vllm.ternary.reference import signed_block_hadamard

    monkeypatch.setattr(linear, "DP4A_MAX_M", max_m)
    n, k = 64, 1024
    packed, scales = layer(n, k, seed=8)
    signs = (torch.randint(0, 2, (k,), generator=torch.Generator().manual_seed(9)).float() * 2 - 1).to(DEV)
    off = linear.prepare(packed, scales, signs, dp4a=False)
    on = linear.prepare(packed, scales, signs, dp4a=True)
    assert linear.route(1, off).path == "gemv"
    assert linear.route(1, on).path == "dp4a" and on.dp4a[0] == dp4a.default_config(n, k)
    assert linear.route(max_m, on).config == dp4a.default_config(n, k, max_m)
    assert linear.route(max_m + 1, on).path == "gemv"  # beyond: the GEMV as before
    for m in sorted({1, max_m}):
        x = rows_of(m, k, seed=10)
        want = signed_block_hadamard(x.float(), signs, 1024) @ dequantize(packed, scales, 128).float().t()
        for y in (linear.ternary_linear(x, on),  # rotation and prep in one kernel, then the GEMV
                  linear.ternary_linear(signed_block_hadamard(x.float(), signs, 1024).to(torch.bfloat16), on,
                                        rotated=True)):  # the prep alone
            assert y.shape == (m, n) and y.dtype == torch.bfloat16
            assert (y.float() - want).norm() / want.norm() < 8e-3  # the bf16 output (and bf16 x' for rotated)
        bias = torch.randn(n, generator=torch.Generator().manual_seed(11)).to(DEV)
        y = linear.ternary_linear(x, on, bias=bias)
        assert (y.float() - (want + bias)).norm() / (want + bias).norm() < 8e-3


def test_default_config_refuses_widths_the_kernel_cannot_step():
    assert dp4a.default_config(5120, 5120) is not None and dp4a.default_config(17408, 5120).split == 4
    assert dp4a.default_config(5120, 8704).split == 8
    assert dp4a.default_config(64, 640) is None  # 40 words: not a multiple of BW = 32
    assert dp4a.default_config(5120, 5120, rows=dp4a.MAX_ROWS) is not None
    assert dp4a.default_config(5120, 5120, rows=dp4a.MAX_ROWS + 1) is None
