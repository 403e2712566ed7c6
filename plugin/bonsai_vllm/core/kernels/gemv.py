"""Decode GEMV/GEMM for small batches (M = 1 … 64 rows): y = xr · W'^T straight from the 2-bit codes.

Reference (the judge): `xr.float() @ core.ternary.dequantize(packed, scales, 128).t()`, i.e.
`core.ternary.ternary_linear_ref` without the rotation (`xr` is already H(s ⊙ x)).

At small M the layer is one pass over the weights: 2.125 bits per weight (codes + one fp16 scale per 128)
against 16 for bf16, so a kernel that reads the codes and scales once can beat a dense cuBLAS GEMV by up
to 7.5×. On an H200 (4.2 TB/s) the codes arrive about as fast as ~2 instructions per weight can use them,
so the decode is shaped to need one integer instruction per weight:

    code i of a word sits at bits 2i. With w' = word | 0x4B000000 (once per word), for j = 0…7
    w' & (0x4B000000 | 3 << 2j) is the float 2^23 + code·4^j (the code lands in the mantissa,
    unshifted); subtracting 2^23 + 4^j leaves (code − 1)·4^j exactly. Codes 8…15 use
    (word >> 16) | 0x4B000000, one shift per word. The 4^j is undone on the activation side (x·4^-j,
    exact), once per call for all rows of W.

So a weight costs one LOP3, one FADD and one FFMA (checked in the SASS: written naively, the and+or took
two LOP3s, one immediate each, and the accumulation an extra FMUL + FADD). The activations come
"planar": x' [M, 16, K/16] with x'[m, i, w] = x[m, 16w + i] · 4^-(i mod 8) (hadamard.gemv_order, or the
rotation kernel writing it directly, block_hadamard(..., gemv_order=True)). Code position i of a tile of
words [BN, BW] then meets x'[m, i, w0:w0+BW], a contiguous vector in the same layout as the words: no
reshapes, no layout conversions (a first version that decoded to [BN, BW, 16] and reshaped spent 10×
longer moving the tile through shared memory).

Two variants:
- `fma` (M = 1; a few rows run as separate programs): float32 FMAs into a [BN, BW] accumulator, times the
  exact float32 group scale once per word; weight loads double-buffered by hand (plain loads are not
  software-pipelined by Triton).
- `dot` (M >= 2): each code position i is one tensor-core product [BN, BW] · [BW, BM] (16 per step), the
  decoded weights times their group scale as bf16 (the scale is rounded to bf16 there: relative 2^-9 per
  group, what dequantizing to bf16 does), x' in bf16; M padded to BM >= 16 (the decode is the cost).

Measured on the H200 (docs/benchmarks.md): `fma` at M = 1 runs at 4-12× the floor for reading the codes
once (1.9× faster than bf16 cuBLAS on gate_up, 0.8× on down): ~3.3 instructions per weight against ~2 that
the issue rate allows at full bandwidth, and the N = 5120 layers launch too few programs to hide latency
(split-K would help). `dot` is slower than bf16 cuBLAS: Triton moves each decoded [BN, BW] operand
through shared memory behind a barrier, per small dot (~9 instructions per weight in the SASS).
"""

from __future__ import annotations

import torch

from bonsai_vllm.core.kernels._triton import dot_dtype, require, tl, triton

if triton is not None:

    @triton.jit
    def _decode(pm, J: tl.constexpr):
        """(code − 1)·4^J as float32 for code J of each word; pm = word | 0x4B000000 (the caller ORs the
        exponent in once per word, and passes (word >> 16) | 0x4B000000 for codes 8..15), so that one AND
        with an immediate (one LOP3) keeps the exponent and the code's two bits."""
        return (pm & (0x4B000000 | (3 << (2 * J)))).to(tl.float32, bitcast=True) - (8388608.0 + (1 << (2 * J)))

    @triton.jit
    def _gemv_fma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, KW, stride_xm, stride_ym,
                         BN: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr):
        # grid: (M, cdiv(N, BN)); one row of x' per program (the row index varies fastest, so the programs
        # that share a tile of W run together and the later rows' reads of it hit L2).
        m = tl.program_id(0)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = rn < N
        G = KW // 8  # groups of 128 (8 words) per row
        wcol = tl.arange(0, BW)
        wmask = nmask[:, None] & (wcol < KW)[None, :]
        # [BN, BW] words; masked-off words read as codes 0b01, value 0
        p = tl.load(w_ptr + rn[:, None] * KW + wcol[None, :], mask=wmask, other=0x55555555)
        s = tl.load(s_ptr + rn[:, None] * G + (wcol // 8)[None, :], mask=wmask, other=0.0)  # scale of each word
        acc = tl.zeros([BN, BW], dtype=tl.float32)
        for it in range(0, tl.cdiv(KW, BW)):
            # issue the next step's loads before this step's arithmetic (two tiles in flight per warp)
            wnext = wcol + BW
            nmask2 = nmask[:, None] & (wnext < KW)[None, :]
            p_next = tl.load(w_ptr + rn[:, None] * KW + wnext[None, :], mask=nmask2, other=0x55555555)
            s_next = tl.load(s_ptr + rn[:, None] * G + (wnext // 8)[None, :], mask=nmask2, other=0.0)
            lo = p | 0x4B000000
            hi = (p >> 16) | 0x4B000000
            xrow = x_ptr + m * stride_xm + wcol  # x'[m, 0, wcol]
            xmask = wcol < KW
            t = tl.zeros([BN, BW], dtype=tl.float32)
            for j in tl.static_range(8):
                xl = tl.load(xrow + j * KW, mask=xmask, other=0.0)  # x'[m, j, w]: codes j
                xh = tl.load(xrow + (j + 8) * KW, mask=xmask, other=0.0)  # x'[m, j + 8, w]: codes j + 8
                # explicit FMAs: written as t += a·b + c·d the compiler emitted FMUL + FFMA + FADD
                t = tl.fma(_decode(lo, j), xl[None, :], t)
                t = tl.fma(_decode(hi, j), xh[None, :], t)
            acc = tl.fma(t, s.to(tl.float32), acc)
            p, s, wcol = p_next, s_next, wnext
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + rn, y.to(y_ptr.dtype.element_ty), mask=nmask)

    @triton.jit(do_not_specialize=["M"])
    def _gemv_dot_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, KW, stride_xm, stride_ym,
                         BM: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr,
                         DT: tl.constexpr):
        # grid: (cdiv(M, BM), cdiv(N, BN)). y^T tile [BN, BM] = Σ_i W'_i[BN, BW] · x'_i[BW, BM] over the 16
        # code positions i: W's rows are the MMA's M side (>= 16 even for a batch of 1).
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mmask = rm < M
        nmask = rn < N
        G = KW // 8
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for it in range(0, tl.cdiv(KW, BW)):
            wcol = it * BW + tl.arange(0, BW)
            wmask = nmask[:, None] & (wcol < KW)[None, :]
            # [BN, BW] words; masked-off words read as codes 0b01, value 0
            p = tl.load(w_ptr + rn[:, None] * KW + wcol[None, :], mask=wmask, other=0x55555555)
            s = tl.load(s_ptr + rn[:, None] * G + (wcol // 8)[None, :], mask=wmask, other=0.0).to(tl.float32)
            lo = p | 0x4B000000
            hi = (p >> 16) | 0x4B000000
            xb = x_ptr + rm[None, :] * stride_xm + wcol[:, None]  # x'[m, 0, w] as [BW, BM]
            xmask = mmask[None, :] & (wcol < KW)[:, None]
            for j in tl.static_range(8):
                xl = tl.load(xb + j * KW, mask=xmask, other=0.0).to(DT)
                xh = tl.load(xb + (j + 8) * KW, mask=xmask, other=0.0).to(DT)
                acc = tl.dot((_decode(lo, j) * s).to(DT), xl, acc, out_dtype=tl.float32)
                acc = tl.dot((_decode(hi, j) * s).to(DT), xh, acc, out_dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[None, :] & nmask[:, None])


# (variant, BM, BN, BW, num_warps, num_stages) per batch size. The fastest configurations of the H200 sweep
# (bench_kernels --sweep, 2026-11-29; docs/benchmarks.md) at the 27B's per-rank shapes; they also fit the
# RTX 50's ~100 KB of shared memory per block (checked by compiling for sm_120).
def default_config(m: int, n: int, k: int) -> tuple:
    if m == 1:
        return ("fma", 1, 32, 32, 2, 1) if n > 8192 else ("fma", 1, 64, 32, 4, 1)
    if m <= 8:
        return ("dot", 16, 16, 16, 1, 3)
    if m <= 16:
        return ("dot", 16, 32, 16, 2, 3) if n > 5120 else ("dot", 16, 16, 16, 1, 3)
    if m <= 32:
        return ("dot", 32, 32, 16, 2, 3)
    return ("dot", 64, 32, 16, 2, 3) if n > 8192 else ("dot", 64, 64, 32, 4, 2)


def x_dtype(config: tuple) -> torch.dtype:
    """dtype of x' a config reads: float32 for the FMA variant, bf16 for the tensor-core one."""
    return torch.float32 if config[0] == "fma" else torch.bfloat16


def ternary_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 *, prepared: bool = False, out: torch.Tensor | None = None, config: tuple | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y [M, N] = xr [M, K] @ W'^T, W' = (code − 1) × group scale, from the packed codes.

    x is the rotated input xr (any float dtype; one extra small launch makes x'), or with `prepared=True`
    already x' = hadamard.gemv_order(xr, dtype=x_dtype(config)) [M, K] (the rotation kernel writes it on
    the decode path). Returns `out_dtype` (default: x's dtype, bf16 for prepared input).
    """
    require()
    n, kw = packed.shape
    k = kw * 16
    if x.shape[-1] != k or scales.shape != (n, k // 128) or k % 128:
        raise ValueError(f"ternary_gemv: x width {x.shape[-1]}, weight [{n}, {k}] (packed {list(packed.shape)}), "
                         f"scales {list(scales.shape)} do not fit (K % 128 == 0, scales [N, K/128])")
    m = x.numel() // k
    config = config or default_config(m, n, k)
    if prepared:
        xp = x.reshape(m, k)
        out_dtype = out_dtype or torch.bfloat16
    else:
        from bonsai_vllm.core.kernels.hadamard import gemv_order

        xp = gemv_order(x, dtype=x_dtype(config))
        out_dtype = out_dtype or x.dtype
    if xp.stride(-1) != 1:
        xp = xp.contiguous()
    y = torch.empty(m, n, dtype=out_dtype, device=x.device) if out is None else out.view(m, n)
    variant, bm, bn, bw, warps, stages = config
    b = bias if bias is not None else scales
    if variant == "fma":
        _gemv_fma_kernel[(m, triton.cdiv(n, bn))](
            xp, packed, scales, b, y, n, kw, xp.stride(0), y.stride(0),
            BN=bn, BW=bw, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages)
    else:
        _gemv_dot_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            xp, packed, scales, b, y, m, n, kw, xp.stride(0), y.stride(0),
            BM=bm, BN=bn, BW=bw, HAS_BIAS=bias is not None, DT=dot_dtype(), num_warps=warps, num_stages=stages)
    return y
