"""Decode GEMV/GEMM for small batches (M = 1 … 64 rows): y = xr · W'^T straight from the 2-bit codes.

Reference (the judge): `xr.float() @ ternary.reference.dequantize(packed, scales, 128).t()`, i.e.
`ternary.reference.ternary_linear_ref` without the rotation (`xr` is already H(s ⊙ x)).

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

Two variants (`GemvConfig.variant`; `default_config` picks one per shape):
- `fma` (M = 1, 2; more rows run as separate programs that share each weight tile through L2): float32
  FMAs into a [BN, BW] accumulator, times the exact float32 group scale once per word; weight loads
  double-buffered by hand (plain loads are not software-pipelined by Triton). Optionally split-K: program
  (m, t, s) walks only slice s of K, and the float32 partials are summed by one of two reductions
  (`_epilogue`): "fixup" (one launch: each program stores its partial, counts itself in on its tile's
  counter, and the last to arrive sums the partials in slice order, deterministic, writes y and resets the
  counter) or "pass" (partials, then `_splitk_reduce_kernel`).
- `dot` (M >= 3 when W8 is not kept): each code position i is one tensor-core product [BN, BW] · [BW, BM]
  (16 per step), the decoded weights times their group scale as bf16 (the scale is rounded to bf16 there:
  relative 2^-9 per group, what dequantizing to bf16 does), x' in bf16; M padded to BM >= 16 (the decode
  is the cost).

Measured and not dispatched (figures in docs/benchmarks.md, `make bench-decode`): `rows` (benchmarks/
gemv_variants.py), one program decoding a weight tile once for BM rows held in registers. It lost to `fma`
at M = 2 and to `dot` at M = 4 … 16 because Triton converts each x' tile [BM, BW] to the accumulator's
layout through shared memory, two barriers per code position (ptxas sm_90: STSM + LDSM + 2 BAR per load).
The "atomic" split-K reduction (fp32 atomic_add, then a cast pass) was the slowest of the three everywhere
and is gone.

Where these stand against bf16 cuBLAS and the byte floor: docs/benchmarks.md (`make bench-kernels`). What
keeps `fma` above the floor is instructions (~3.3 per weight against the ~2 the issue rate allows at full
bandwidth) and the launch and ramp of layers whose floor is about 1 µs; `dot` pays ~9 instructions per
weight (each decoded [BN, BW] operand goes through shared memory behind a barrier, per small dot), so with
W8 kept at load the int8 GEMM (int8mm.py, BM = 16) takes over from M = 3 (linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bonsai_vllm.triton_runtime import dot_dtype, require, tl, triton

if triton is not None:

    @triton.jit
    def _decode(pm, J: tl.constexpr):
        """(code − 1)·4^J as float32 for code J of each word; pm = word | 0x4B000000 (the caller ORs the
        exponent in once per word, and passes (word >> 16) | 0x4B000000 for codes 8..15), so that one AND
        with an immediate (one LOP3) keeps the exponent and the code's two bits."""
        return (pm & (0x4B000000 | (3 << (2 * J)))).to(tl.float32, bitcast=True) - (8388608.0 + (1 << (2 * J)))

    @triton.jit
    def _word_tile(w_ptr, s_ptr, rn, nmask, wcol, kend, KW, G):
        """W' words [BN, BW] of rows rn and word columns wcol (< kend), and each word's group scale. Words
        masked off read as codes 0b01, value 0, so they add nothing."""
        m = nmask[:, None] & (wcol < kend)[None, :]
        p = tl.load(w_ptr + rn[:, None] * KW + wcol[None, :], mask=m, other=0x55555555)
        s = tl.load(s_ptr + rn[:, None] * G + (wcol // 8)[None, :], mask=m, other=0.0)
        return p, s

    @triton.jit
    def _epilogue(v, y_ptr, y_off, ws_ptr, ws_off, ws_split, b_ptr, n_off, mask, cnt_ptr, tile, pid_s, nsplit,
                  REDUCE: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Write one program's float32 sums v (any shape; y_off / ws_off / n_off / mask index it alike).

        REDUCE 0: no split, v is the answer. 2 ("pass"): store the partial at ws[pid_s] [SPLIT, M, N] (a
        reduce pass follows). 3 ("fixup"): store the partial, then the program that finishes its tile last
        sums ws[0..SPLIT) in order (deterministic) and writes y; it resets the tile's counter to 0 for the
        next launch. (1 was the dropped "atomic" reduction.)
        """
        if REDUCE == 0:
            if HAS_BIAS:
                v += tl.load(b_ptr + n_off, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + y_off, v.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ws_ptr + pid_s * ws_split + ws_off, v, mask=mask)
            if REDUCE == 3:
                tl.debug_barrier()  # every thread's partial stored before the (releasing) count
                done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
                if done == nsplit - 1:  # the last program of this tile: all partials are visible
                    tot = tl.zeros_like(v)
                    for s in range(0, nsplit):
                        tot += tl.load(ws_ptr + s * ws_split + ws_off, mask=mask, other=0.0, cache_modifier=".cg")
                    if HAS_BIAS:
                        tot += tl.load(b_ptr + n_off, mask=mask, other=0.0).to(tl.float32)
                    tl.store(y_ptr + y_off, tot.to(y_ptr.dtype.element_ty), mask=mask)
                    tl.atomic_xchg(cnt_ptr + tile, 0)

    @triton.jit(do_not_specialize=["ITERS", "nsplit"])
    def _gemv_fma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, N, KW, ITERS, nsplit, stride_xm,
                         stride_ym, BN: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr,
                         REDUCE: tl.constexpr):
        # grid: (M, cdiv(N, BN), SPLIT); one row of x' per program (the row index varies fastest, so the
        # programs that share a tile of W run together and the later rows' reads of it hit L2). Program
        # (m, t, s) covers words [s·ITERS·BW, (s+1)·ITERS·BW) of K (split-K: all of K when SPLIT = 1).
        m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        rn = pid_n * BN + tl.arange(0, BN)
        nmask = rn < N
        G = KW // 8  # groups of 128 (8 words) per row
        k0 = pid_s * ITERS * BW
        kend = tl.minimum(k0 + ITERS * BW, KW)
        wcol = k0 + tl.arange(0, BW)
        p, s = _word_tile(w_ptr, s_ptr, rn, nmask, wcol, kend, KW, G)  # [BN, BW] words and their scales
        acc = tl.zeros([BN, BW], dtype=tl.float32)
        for it in range(0, ITERS):
            # issue the next step's loads before this step's arithmetic (two tiles in flight per warp)
            wnext = wcol + BW
            p_next, s_next = _word_tile(w_ptr, s_ptr, rn, nmask, wnext, kend, KW, G)
            lo = p | 0x4B000000
            hi = (p >> 16) | 0x4B000000
            xrow = x_ptr + m * stride_xm + wcol  # x'[m, 0, wcol]
            xmask = wcol < kend
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
        _epilogue(y, y_ptr, m * stride_ym + rn, ws_ptr, m * N + rn, tl.num_programs(0) * N, b_ptr, rn, nmask,
                  cnt_ptr, m * tl.num_programs(1) + pid_n, pid_s, nsplit, REDUCE, HAS_BIAS)

    @triton.jit(do_not_specialize=["M", "nsplit"])
    def _splitk_reduce_kernel(ws_ptr, b_ptr, y_ptr, M, N, nsplit, stride_ym, BLOCK: tl.constexpr,
                              HAS_BIAS: tl.constexpr):
        # grid: (cdiv(M·N, BLOCK),); y = Σ_s ws[s] (+ bias), ws float32 [SPLIT, M, N] contiguous.
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < M * N
        tot = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(0, nsplit):
            tot += tl.load(ws_ptr + s * M * N + i, mask=mask, other=0.0)
        if HAS_BIAS:
            tot += tl.load(b_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + (i // N) * stride_ym + i % N, tot.to(y_ptr.dtype.element_ty), mask=mask)

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
            p, s = _word_tile(w_ptr, s_ptr, rn, nmask, wcol, KW, KW, G)  # [BN, BW] words and their scales
            s = s.to(tl.float32)
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


REDUCE = {"fixup": 3, "pass": 2}  # split-K reductions (see _epilogue), by name
_COUNTERS: dict = {}  # device -> int32 [>= tiles] zeros: the "fixup" reduction's per-tile arrival counts


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration of `ternary_gemv` (see the module docstring for the variants)."""

    variant: str  # "fma" (float32 FMAs, one row of x' per program) or "dot" (tensor cores, BM rows per program)
    bm: int  # rows of x' per program: 1 for "fma"; for "dot" the product's row tile (M padded to it, >= 16)
    bn: int  # rows of W (outputs) per program
    bw: int  # words of W per step along K (16 codes each)
    warps: int  # num_warps
    stages: int  # num_stages
    split: int = 1  # "fma" only: K cut into up to this many slices, one program each (split_plan); 1: none
    reduce: str | None = None  # how a split's float32 partials are summed: "fixup" or "pass" (see _epilogue)

    def __post_init__(self):
        if self.split > 1 and self.reduce is None:
            raise ValueError(f"GemvConfig: split {self.split} needs a reduction (one of {sorted(REDUCE)})")

    def __str__(self) -> str:
        s = f"{self.variant} bm={self.bm} bn={self.bn} bw={self.bw} warps={self.warps} stages={self.stages}"
        return s + (f" split={self.split} {self.reduce}" if self.split > 1 else "")


# The fastest checked configuration of the H200 run of bench_decode (2026-11-29; docs/benchmarks.md) at the
# 27B's per-rank TP=2 shapes, (M, N, K) -> config. µs in the comments: that config / the one used before /
# bf16 cuBLAS. Where the best new candidate beat the old path by less than 3 % (twice the run's repeat spread
# and more) the old path was kept.
_MEASURED = {
    # gate_up 21.2 / 24.1 / 44.8 (fixup: 21.6)
    (1, 17408, 5120): GemvConfig(variant="fma", bm=1, bn=32, bw=32, warps=2, stages=1, split=8, reduce="pass"),
    # down 13.6 / 33.7 / 27.1
    (1, 5120, 8704): GemvConfig(variant="fma", bm=1, bn=32, bw=32, warps=2, stages=1, split=8, reduce="fixup"),
    # qkv 12.5 / 18.7 / 22.9
    (1, 7168, 5120): GemvConfig(variant="fma", bm=1, bn=32, bw=32, warps=2, stages=1, split=4, reduce="fixup"),
    # o_proj, gdn_out 7.4 / 11.0 / 10.9
    (1, 5120, 3072): GemvConfig(variant="fma", bm=1, bn=64, bw=32, warps=4, stages=1, split=4, reduce="fixup"),
    # gdn_in 12.7 / 18.3 / 21.9
    (1, 8192, 5120): GemvConfig(variant="fma", bm=1, bn=64, bw=32, warps=4, stages=1, split=2, reduce="fixup"),
    # 39.9 / 50.8 (dot) / 43.7
    (2, 17408, 5120): GemvConfig(variant="fma", bm=1, bn=32, bw=32, warps=2, stages=1, split=4, reduce="fixup"),
    # 23.0 / 39.4 / 27.4
    (2, 5120, 8704): GemvConfig(variant="fma", bm=1, bn=32, bw=32, warps=2, stages=1, split=4, reduce="fixup"),
    # 19.1 / 24.8 / 23.6
    (2, 7168, 5120): GemvConfig(variant="fma", bm=1, bn=32, bw=32, warps=2, stages=1, split=4, reduce="fixup"),
    # 10.3 / 14.4 / 10.2
    (2, 5120, 3072): GemvConfig(variant="fma", bm=1, bn=32, bw=32, warps=2, stages=1, split=4, reduce="fixup"),
    # 20.1 / 25.0 / 22.6 (split 4: 21.3)
    (2, 8192, 5120): GemvConfig(variant="fma", bm=1, bn=32, bw=32, warps=2, stages=1),
}


def default_config(m: int, n: int, k: int) -> GemvConfig:
    """The GEMV configuration for a batch of m rows of a [n, k] layer: the measured winner at the 27B's
    shapes (_MEASURED), else by the same rules: split-K `fma` at M <= 2 (a slice of K per program, so the
    N = 5120 layers launch enough programs), the tensor-core `dot` beyond (at M = 4 … 16 it still beat the
    multi-row `rows` kernel and M programs of `fma`; with W8 kept at load, linear.py takes the int8 path
    there instead)."""
    if (m, n, k) in _MEASURED:
        return _MEASURED[(m, n, k)]
    if m <= 2:
        if m == 1 and k <= 3072:
            return GemvConfig(variant="fma", bm=1, bn=64, bw=32, warps=4, stages=1, split=4, reduce="fixup")
        return GemvConfig(variant="fma", bm=1, bn=32, bw=32, warps=2, stages=1, split=8 if m == 1 and k > 5120 else 4,
                          reduce="fixup")
    if m <= 8:
        return GemvConfig(variant="dot", bm=16, bn=16, bw=16, warps=1, stages=3)
    if m <= 16:
        if n > 5120:
            return GemvConfig(variant="dot", bm=16, bn=32, bw=16, warps=2, stages=3)
        return GemvConfig(variant="dot", bm=16, bn=16, bw=16, warps=1, stages=3)
    if m <= 32:
        return GemvConfig(variant="dot", bm=32, bn=32, bw=16, warps=2, stages=3)
    if n > 8192:
        return GemvConfig(variant="dot", bm=64, bn=32, bw=16, warps=2, stages=3)
    return GemvConfig(variant="dot", bm=64, bn=64, bw=32, warps=4, stages=2)


def x_dtype(config: GemvConfig) -> torch.dtype:
    """dtype of x' a config reads: float32 for the FMA variants, bf16 for the tensor-core one."""
    return torch.bfloat16 if config.variant == "dot" else torch.float32


def split_plan(kw: int, bw: int, split: int) -> tuple[int, int]:
    """(steps of BW words per program, programs along K) for a K of kw words cut into `split` slices."""
    steps = triton.cdiv(kw, bw)
    iters = triton.cdiv(steps, split)
    return iters, triton.cdiv(steps, iters)  # no empty slice: e.g. 17 steps in 8 -> 3 steps × 6 slices


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    c = _COUNTERS.get(device)
    if c is None or c.numel() < tiles:
        c = _COUNTERS[device] = torch.zeros(max(tiles, 1 << 14), dtype=torch.int32, device=device)
    return c


def ternary_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 *, prepared: bool = False, out: torch.Tensor | None = None, config: GemvConfig | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y [M, N] = xr [M, K] @ W'^T, W' = (code − 1) × group scale, from the packed codes.

    x is the rotated input xr (any float dtype; one extra small launch makes x'), or with `prepared=True`
    already x' = hadamard.gemv_order(xr, dtype=x_dtype(config)) [M, K] (the rotation kernel writes it on
    the decode path). Returns `out_dtype` (default: x's dtype, bf16 for prepared input). config: default
    `default_config(M, N, K)`.

    Split-K configs ("fma" with split > 1) keep float32 partials in a per-call workspace; the "fixup"
    reduction also uses a per-device counter buffer that each launch leaves at zero, so two such launches
    must not run concurrently on one device (one stream per rank in vLLM).
    """
    require()
    n, kw = packed.shape
    k = kw * 16
    if x.shape[-1] != k or scales.shape != (n, k // 128) or k % 128:
        raise ValueError(f"ternary_gemv: x width {x.shape[-1]}, weight [{n}, {k}] (packed {list(packed.shape)}), "
                         f"scales {list(scales.shape)} do not fit (K % 128 == 0, scales [N, K/128])")
    m = x.numel() // k
    c = config or default_config(m, n, k)
    if c.variant not in ("fma", "dot"):
        raise ValueError(f"ternary_gemv: unknown variant {c.variant!r} in config {c} (the measured-only "
                         "rows variant is benchmarks/gemv_variants.py's)")
    if prepared:
        xp = x.reshape(m, k)
        out_dtype = out_dtype or torch.bfloat16
    else:
        from bonsai_vllm.ternary.kernels.hadamard import gemv_order

        xp = gemv_order(x, dtype=x_dtype(c))
        out_dtype = out_dtype or x.dtype
    if xp.stride(-1) != 1:
        xp = xp.contiguous()
    y = torch.empty(m, n, dtype=out_dtype, device=x.device) if out is None else out.view(m, n)
    b = bias if bias is not None else scales
    if c.variant == "dot":
        _gemv_dot_kernel[(triton.cdiv(m, c.bm), triton.cdiv(n, c.bn))](
            xp, packed, scales, b, y, m, n, kw, xp.stride(0), y.stride(0),
            BM=c.bm, BN=c.bn, BW=c.bw, HAS_BIAS=bias is not None, DT=dot_dtype(), num_warps=c.warps,
            num_stages=c.stages)
        return y
    iters, nsplit = split_plan(kw, c.bw, c.split)
    if nsplit > 1 and c.reduce not in REDUCE:
        raise ValueError(f"ternary_gemv: unknown split-K reduction {c.reduce!r} in config {c} (one of "
                         f"{sorted(REDUCE)})")
    mode = REDUCE[c.reduce] if nsplit > 1 else 0
    cnt = ws = y
    if mode == 3:
        cnt = _counters(y.device, m * triton.cdiv(n, c.bn))
    if mode:  # the float32 partials, [SPLIT, M, N]
        ws = torch.empty(nsplit, m, n, dtype=torch.float32, device=y.device)
    _gemv_fma_kernel[(m, triton.cdiv(n, c.bn), nsplit)](
        xp, packed, scales, b, y, ws, cnt, n, kw, iters, nsplit, xp.stride(0), y.stride(0),
        BN=c.bn, BW=c.bw, HAS_BIAS=bias is not None and mode in (0, 3), REDUCE=mode, num_warps=c.warps,
        num_stages=c.stages)
    if mode == 2:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](ws, b, y, m, n, nsplit, y.stride(0),
                                                             BLOCK=block, HAS_BIAS=bias is not None, num_warps=4)
    return y
