"""The multi-row decode GEMV `rows`, measured and not dispatched: bench_decode times it beside the served
kernels of `gemv.py`, which hold only what `gemv.default_config` can pick.

One program decodes a [BN, BW] tile of W once per step and applies it to BM rows of x' held in registers
(acc [BM, BN, BW]); it lost to `fma` at M = 2 and to `dot` at M = 4 … 16 (gemv.py's docstring says why;
docs/benchmarks.md has the run). Split-K like `fma`, with either served reduction ("fixup", "pass").
(The "atomic" split-K reduction of `fma` was measured too, slowest of the three everywhere, and dropped:
docs/benchmarks.md has the figures.)

`ternary_gemv_variant` takes a `gemv.GemvConfig`: variant "rows" runs here, anything else goes to the
served `gemv.ternary_gemv`. Same inputs and outputs as that. The kernel reuses gemv.py's decode, tile load
and epilogue, so the comparison is with the same maths.
"""

from __future__ import annotations

import torch

from bonsai_vllm.ternary.kernels import gemv
from bonsai_vllm.triton_runtime import require, tl, triton

if triton is not None:
    from bonsai_vllm.ternary.kernels.gemv import _decode, _epilogue, _word_tile

    @triton.jit(do_not_specialize=["M", "ITERS", "nsplit"])
    def _gemv_rows_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, KW, ITERS, nsplit, stride_xm,
                          stride_ym, BM: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr, HAS_BIAS: tl.constexpr,
                          REDUCE: tl.constexpr):
        # grid: (cdiv(M, BM), cdiv(N, BN), SPLIT). One program decodes a [BN, BW] tile of W once per step
        # and applies it to BM rows of x' held in registers: acc [BM, BN, BW] += W'_j ⊙ x'_j over the 16
        # code positions j. The decoded weight is scaled once (one FMUL, shared by the BM rows) so each
        # (weight, row) costs one FFMA: 3 + BM instructions per weight instead of ~3.3·BM for BM programs.
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        pid_n = tl.program_id(1)
        pid_s = tl.program_id(2)
        rn = pid_n * BN + tl.arange(0, BN)
        mmask = rm < M
        nmask = rn < N
        G = KW // 8
        k0 = pid_s * ITERS * BW
        kend = tl.minimum(k0 + ITERS * BW, KW)
        wcol = k0 + tl.arange(0, BW)
        p, s = _word_tile(w_ptr, s_ptr, rn, nmask, wcol, kend, KW, G)  # [BN, BW] words and their scales
        acc = tl.zeros([BM, BN, BW], dtype=tl.float32)
        xrow = x_ptr + rm[:, None] * stride_xm  # [BM, 1]
        for it in range(0, ITERS):
            wnext = wcol + BW
            p_next, s_next = _word_tile(w_ptr, s_ptr, rn, nmask, wnext, kend, KW, G)
            lo = p | 0x4B000000
            hi = (p >> 16) | 0x4B000000
            sf = s.to(tl.float32)
            xb = xrow + wcol[None, :]  # x'[m, 0, w] as [BM, BW]
            xmask = mmask[:, None] & (wcol < kend)[None, :]
            for j in tl.static_range(8):
                # loaded 2-D and expanded: Triton then loads x' straight in the accumulator's layout
                # (a [BM, 1, BW] load got its own layout and a shared-memory conversion per load)
                xl = tl.load(xb + j * KW, mask=xmask, other=0.0)
                xh = tl.load(xb + (j + 8) * KW, mask=xmask, other=0.0)
                acc = tl.fma((_decode(lo, j) * sf)[None, :, :], xl[:, None, :], acc)
                acc = tl.fma((_decode(hi, j) * sf)[None, :, :], xh[:, None, :], acc)
            p, s, wcol = p_next, s_next, wnext
        y = tl.sum(acc, axis=2)  # [BM, BN]
        _epilogue(y, y_ptr, rm[:, None] * stride_ym + rn[None, :], ws_ptr, rm[:, None] * N + rn[None, :], M * N,
                  b_ptr, rn[None, :], mmask[:, None] & nmask[None, :], cnt_ptr,
                  tl.program_id(0) * tl.num_programs(1) + pid_n, pid_s, nsplit, REDUCE, HAS_BIAS)


def ternary_gemv_variant(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                         bias: torch.Tensor | None = None, *, prepared: bool = False, out: torch.Tensor | None = None,
                         config: gemv.GemvConfig | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """gemv.ternary_gemv for any configuration bench_decode times: variant "rows" runs here, everything else
    through the served function."""
    c = config or gemv.default_config(x.numel() // x.shape[-1], packed.shape[0], x.shape[-1])
    if c.variant != "rows":
        return gemv.ternary_gemv(x, packed, scales, bias, prepared=prepared, out=out, config=c, out_dtype=out_dtype)
    require()
    n, kw = packed.shape
    iters, nsplit = gemv.split_plan(kw, c.bw, c.split)
    k = kw * 16
    if x.shape[-1] != k or scales.shape != (n, k // 128) or k % 128:
        raise ValueError(f"ternary_gemv_variant: x width {x.shape[-1]} does not fit the weight [{n}, {k}]")
    m = x.numel() // k
    if prepared:
        xp = x.reshape(m, k)
        out_dtype = out_dtype or torch.bfloat16
    else:
        from bonsai_vllm.ternary.kernels.hadamard import gemv_order

        xp = gemv_order(x, dtype=gemv.x_dtype(c))
        out_dtype = out_dtype or x.dtype
    if xp.stride(-1) != 1:
        xp = xp.contiguous()
    y = torch.empty(m, n, dtype=out_dtype, device=x.device) if out is None else out.view(m, n)
    b = bias if bias is not None else scales
    if nsplit > 1 and c.reduce not in gemv.REDUCE:
        raise ValueError(f"ternary_gemv_variant: unknown split-K reduction {c.reduce!r} in config {c} (one of "
                         f"{sorted(gemv.REDUCE)})")
    mode = gemv.REDUCE[c.reduce] if nsplit > 1 else 0
    mt = triton.cdiv(m, c.bm)  # programs along M
    cnt = ws = y
    if mode == 3:
        cnt = gemv._counters(y.device, mt * triton.cdiv(n, c.bn))
    if mode:
        ws = torch.empty(nsplit, m, n, dtype=torch.float32, device=y.device)
    _gemv_rows_kernel[(mt, triton.cdiv(n, c.bn), nsplit)](
        xp, packed, scales, b, y, ws, cnt, m, n, kw, iters, nsplit, xp.stride(0), y.stride(0), BM=c.bm, BN=c.bn,
        BW=c.bw, HAS_BIAS=bias is not None and mode in (0, 3), REDUCE=mode, num_warps=c.warps, num_stages=c.stages)
    if mode == 2:
        block = 1024
        gemv._splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            ws, b, y, m, n, nsplit, y.stride(0), BLOCK=block, HAS_BIAS=bias is not None, num_warps=4)
    return y
