"""Signed block Walsh-Hadamard rotation of activations, optionally fused with per-token int8 quantization.

Reference (the judge): `bonsai_vllm.ternary.reference.signed_block_hadamard` (y = fwht(x ⊙ s) per block),
and for the int8 output the first lines of `ternary.reference.ternary_linear_int8_ref` (amax/127 per token,
round half to even).

How the kernel rotates. Sylvester's H_1024 is H_32 ⊗ H_32: write a 1024-block as a 32×32 matrix
X[i1, i2] (column i1·32 + i2, i1 the high index bits); then H_1024 x = vec(H_32 · X · H_32). So a block is
two 32×32 matrix products, which run on the tensor cores: a program loads BM rows' blocks as [BM·32, 32]
(transposed, so i1 comes last), multiplies by H_32, transposes in registers, multiplies by H_32 again
and stores in natural order. H has ±1 entries and x ⊙ s is exact in bf16, so the first product is exact
in the float32 accumulator; its float32 result is split into bf16 hi + lo for the second product
(error ~2⁻¹⁷, far under the bf16 output's rounding). Blocks 256 and 512 (H_16 ⊗ H_16, H_16 ⊗ H_32) work
the same way; 512 is what a TP=2 rank rotates of down_proj's cut block (ternary/partition.py).

Memory-bound: each element is read once and written once (the int8 path reads x twice, the second time
from L2, to quantize with the row's amax without keeping the row in registers).

`rotate_dp4a` rotates decode rows and prepares them for the dp4a GEMV (dp4a.py) in the same kernel, from
the float32 rotation result: one launch and no x' round trip in place of rotation + dp4a.prepare.
"""

from __future__ import annotations

import math

import torch

from bonsai_vllm.triton_runtime import dot_dtype, early_launch, require, tl, triton

# Block size -> (B1, B2): the two Sylvester factors (high index bits, low index bits).
_FACTORS = {256: (16, 16), 512: (16, 32), 1024: (32, 32)}
# Tile shapes for quantizing an already rotated x (no matrix products, any shape will do).
_TILES = {**_FACTORS, 128: (8, 16)}

if triton is not None:
    from bonsai_vllm.ternary.kernels.dp4a import _prepare_groups  # the dp4a prep of a block's groups
    from bonsai_vllm.triton_runtime import launch_dependents

    @triton.jit
    def _sylvester(N: tl.constexpr, DT: tl.constexpr):
        """Unnormalized Sylvester Hadamard [N, N] (N <= 32): H[i, j] = (-1)^popcount(i & j)."""
        a = tl.arange(0, N)
        p = a[:, None] & a[None, :]
        p = p ^ (p >> 4)  # fold the 5 index bits into bit 0: its parity
        p = p ^ (p >> 2)
        p = p ^ (p >> 1)
        return (1 - 2 * (p & 1)).to(tl.float32).to(DT)

    @triton.jit
    def _dot_split(a, h, SPLIT: tl.constexpr, DT: tl.constexpr):
        """a [R, N] float32 @ h [N, N] (±1) with a split into bf16 hi + lo when a is not exact in bf16."""
        hi = a.to(DT)
        acc = tl.dot(hi, h, out_dtype=tl.float32)
        if SPLIT:
            acc += tl.dot((a - hi.to(tl.float32)).to(DT), h, out_dtype=tl.float32)
        return acc

    @triton.jit
    def _tile(x_ptr, s_ptr, rows, rmask, col0, stride_x, norm,
              BM: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
              ROTATE: tl.constexpr, SPLIT_X: tl.constexpr, DT: tl.constexpr):
        """One block of BM rows as float32 [BM, B1, B2] in natural column order, rotated or as is."""
        i1 = tl.arange(0, B1)
        i2 = tl.arange(0, B2)
        if ROTATE:
            off = col0 + i2[:, None] + i1[None, :] * B2  # [B2, B1]: element (i2, i1), i1 last
            x = tl.load(x_ptr + rows[:, None, None] * stride_x + off[None, :, :],
                        mask=rmask[:, None, None], other=0.0).to(tl.float32)
            x = x * tl.load(s_ptr + off).to(tl.float32)[None, :, :]  # x ⊙ s, [BM, B2, B1]
            z = _dot_split(tl.reshape(x, (BM * B2, B1)), _sylvester(B1, DT), SPLIT_X, DT)  # [(r, i2), j1]
            z = tl.reshape(tl.permute(tl.reshape(z, (BM, B2, B1)), (0, 2, 1)), (BM * B1, B2))  # [(r, j1), i2]
            y = _dot_split(z, _sylvester(B2, DT), True, DT)  # [(r, j1), j2]
            return tl.reshape(y, (BM, B1, B2)) * norm
        else:
            off = col0 + i1[:, None] * B2 + i2[None, :]
            return tl.load(x_ptr + rows[:, None, None] * stride_x + off[None, :, :],
                           mask=rmask[:, None, None], other=0.0).to(tl.float32)

    @triton.jit
    def _int8_of(y, scale):
        """y / scale rounded half to even into [-127, 127] as int8, in IEEE arithmetic like
        quantize_per_token_ref (Triton's `/` is not IEEE); a zero scale (an all-zero row) gives zeros."""
        v = tl.math.div_rn(y, tl.maximum(scale, 1.1754943508222875e-38))
        v = (v + 12582912.0) - 12582912.0  # round half to even (1.5·2^23 trick; |v| <= 127)
        return tl.minimum(tl.maximum(v, -127.0), 127.0).to(tl.int8)

    @triton.jit(do_not_specialize=["M"])
    def _rotate_quant_kernel(x_ptr, s_ptr, y_ptr, q_ptr, qs_ptr, M, K, stride_x, stride_y, stride_q, norm,
                             BM: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, ROTATE: tl.constexpr,
                             QUANT: tl.constexpr, GEMV_ORDER: tl.constexpr, SPLIT_X: tl.constexpr,
                             DT: tl.constexpr):
        # grid: (cdiv(M, BM), tiles) without QUANT (one tile per program), (cdiv(M, BM), 1) with QUANT (the
        # program walks its rows' tiles twice: amax first, then quantize).
        TILE: tl.constexpr = B1 * B2
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        rmask = rows < M
        off = tl.arange(0, B1)[:, None] * B2 + tl.arange(0, B2)[None, :]  # [B1, B2] natural order
        if QUANT:
            amax = tl.zeros([BM], dtype=tl.float32)
            for t in range(0, K // TILE):
                y = _tile(x_ptr, s_ptr, rows, rmask, t * TILE, stride_x, norm, BM, B1, B2, ROTATE, SPLIT_X, DT)
                amax = tl.maximum(amax, tl.max(tl.max(tl.abs(y), axis=2), axis=1))
            scale = tl.math.div_rn(amax, 127.0)  # IEEE, as the reference's amax / 127 (Triton's `/` is not)
            for t in range(0, K // TILE):
                y = _tile(x_ptr, s_ptr, rows, rmask, t * TILE, stride_x, norm, BM, B1, B2, ROTATE, SPLIT_X, DT)
                tl.store(q_ptr + rows[:, None, None] * stride_q + t * TILE + off[None, :, :],
                         _int8_of(y, scale[:, None, None]), mask=rmask[:, None, None])
            tl.store(qs_ptr + rows, scale, mask=rmask)
        else:
            t = tl.program_id(1)
            y = _tile(x_ptr, s_ptr, rows, rmask, t * TILE, stride_x, norm, BM, B1, B2, ROTATE, SPLIT_X, DT)
            if GEMV_ORDER:
                # x' for gemv.py, planar: column 16w + i goes to i·(K/16) + w, times 4^-(i mod 8)
                col = t * TILE + off
                dst = (col % 16) * (K // 16) + col // 16 - t * TILE
                y = y * ((127 - 2 * (col % 8)) << 23).to(tl.float32, bitcast=True)[None, :, :]
            else:
                dst = off
            tl.store(y_ptr + rows[:, None, None] * stride_y + t * TILE + dst[None, :, :],
                     y.to(y_ptr.dtype.element_ty), mask=rmask[:, None, None])


    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, qs_ptr, K, stride_x, stride_q, BK: tl.constexpr):
        # grid: (M,). The whole row in registers (BK = next power of two >= K): one read of x, not the two walks
        # over its tiles of _rotate_quant_kernel's QUANT branch; the same maths, so the same bits.
        m = tl.program_id(0)
        cols = tl.arange(0, BK)
        mask = cols < K
        x = tl.load(x_ptr + m * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=0), 127.0)
        tl.store(q_ptr + m * stride_q + cols, _int8_of(x, scale), mask=mask)
        tl.store(qs_ptr + m, scale)

    @triton.jit(do_not_specialize=["M"])
    def _rotate_dp4a_kernel(x_ptr, s_ptr, xa_ptr, xr_ptr, gx_ptr, gr_ptr, sc_ptr, M, K, stride_x, norm,
                            BM: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, SPLIT_X: tl.constexpr,
                            DT: tl.constexpr, INV127: tl.constexpr, EARLY_LAUNCH: tl.constexpr):
        # grid: (K / (B1·B2), cdiv(M, BM)). Program (t, p) rotates block t of rows [p·BM, p·BM + BM) and prepares
        # their groups of 128. The kernel after it (a programmatic dependent) may start fetching its codes now.
        launch_dependents(EARLY_LAUNCH)
        TILE: tl.constexpr = B1 * B2
        t = tl.program_id(0)
        row0 = tl.program_id(1) * BM
        rows = row0 + tl.arange(0, BM)
        y = _tile(x_ptr, s_ptr, rows, rows < M, t * TILE, stride_x, norm, BM, B1, B2, True, SPLIT_X, DT)
        _prepare_groups(tl.reshape(y, (BM * (TILE // 128), 128)), row0, M, t * (TILE // 128), K, xa_ptr, xr_ptr,
                        gx_ptr, gr_ptr, sc_ptr, BM, TILE // 128, INV127)  # y [BM, B1, B2] as the rows' groups


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check(x: torch.Tensor, signs: torch.Tensor, block: int) -> None:
    if block not in _FACTORS:
        raise ValueError(f"block_hadamard: block {block} not supported by the kernel (one of {sorted(_FACTORS)})")
    if x.shape[-1] % block:
        raise ValueError(f"block_hadamard: width {x.shape[-1]} is not a multiple of the block {block}; "
                         "rotate a tensor-parallel cut block with ternary.partition.rotate_partition")
    if signs.shape != (x.shape[-1],):
        raise ValueError(f"block_hadamard: signs shape {list(signs.shape)} != [{x.shape[-1]}]")


def _bm(m: int) -> int:
    # Rows per program of the rotation: enough rows for one tensor-core tile (BM·32 >= 64) at prefill sizes
    # (4 was the fastest at 2048×5120 on the H200), one at decode.
    return 1 if m == 1 else (2 if m <= 64 else 4)


def block_hadamard(x: torch.Tensor, signs: torch.Tensor, block: int = 1024, *, gemv_order: bool = False,
                   dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None, bm: int | None = None,
                   num_warps: int = 4) -> torch.Tensor:
    """H(s ⊙ x) per `block` of the last dim; x [..., K] (K % block == 0), signs [K] (±1); returns x's dtype.

    gemv_order=True returns instead x' [M, K] in `dtype`, laid out for gemv.py (see `gemv_order`): the
    rotation fused with the GEMV's activation preparation, for the decode path.
    """
    require()
    _check(x, signs, block)
    return _launch(x, signs, *_FACTORS[block], gemv_order, dtype, out, bm, num_warps)


def gemv_order(xr: torch.Tensor, *, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotated x [..., K] -> x' [M, K] (viewed [M, 16, K/16]) as gemv.py reads it: x'[m, i, w] =
    xr[m, 16w + i] · 4^-(i mod 8) (exact; `dtype` float32 or bf16). K % 128 == 0."""
    require()
    k = xr.shape[-1]
    tile = next((t for t in (1024, 512, 256, 128) if k % t == 0), None)
    if tile is None:
        raise ValueError(f"gemv_order: width {k} is not a multiple of 128")
    return _launch(xr, None, *_TILES[tile], True, dtype, out, None, 4)


def gemv_order_ref(xr: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of `gemv_order` (float32)."""
    m, k = xr.reshape(-1, xr.shape[-1]).shape
    x = xr.float().reshape(m, k // 16, 16)  # [M, word, i]
    x = x * (4.0 ** -(torch.arange(16, device=xr.device) % 8)).float()
    return x.transpose(1, 2).reshape(m, k)  # [M, i, word]


def _launch(x, signs, b1, b2, order, dtype, out, bm, num_warps):
    x2 = _rows(x)
    m, k = x2.shape
    if out is not None:
        y = out.view(m, k)
    else:
        y = torch.empty(m, k, dtype=dtype if order else x.dtype, device=x.device)
    bm = bm or _bm(m)
    grid = (triton.cdiv(m, bm), k // (b1 * b2))
    _rotate_quant_kernel[grid](x2, x2 if signs is None else signs, y, y, y, m, k, x2.stride(0), y.stride(0), 0,
                               1.0 / math.sqrt(b1 * b2), BM=bm, B1=b1, B2=b2, ROTATE=signs is not None,
                               QUANT=False, GEMV_ORDER=order, SPLIT_X=x.dtype != torch.bfloat16, DT=dot_dtype(),
                               num_warps=num_warps)
    return y if order else y.view(x.shape)


# Batch rows from which rotate_dp4a's programs take two rows each. On the H200 (docs/benchmarks.md, eighteenth
# session, table 4) the kernel alone is 0.05-0.15 µs slower so up to 24-32 rows and 0.5-0.7 µs faster above
# (where one row per program needs more than a wave), and it runs half the programs, so the mma kernel after it
# can start early at more row counts (mma.early_pays). Served: o_proj / GDN-out 1.07-1.08x faster at 20-32 rows,
# gate_up 1.06x at 12-16, 1.015-1.03x at 32-64, never more than 1 % slower. Four or more rows per program were
# slower at every row count.
ROTATE_PAIRS_FROM = 8


def rotate_rows_per_program(m: int) -> int:
    """Rows each program of rotate_dp4a rotates and prepares for m rows."""
    return 2 if m >= ROTATE_PAIRS_FROM else 1


def rotate_dp4a(x: torch.Tensor, signs: torch.Tensor, block: int = 1024, *, out=None, bm: int | None = None):
    """Rows x [K] or [M, K] -> dp4a.Dp4aActivations of H(s ⊙ x) per `block`, one launch (the decode rows);
    `bm` rows per program (a power of two; None: rotate_rows_per_program).

    Equals dp4a.prepare_reference(signed_block_hadamard(x, signs, block)) up to the rotation's float32
    rounding (an input on a rounding boundary of its int8 may land one step over)."""
    from bonsai_vllm.ternary.kernels import dp4a

    require()
    x2 = _rows(x)
    _check(x2, signs, block)
    m, k = x2.shape
    b1, b2 = _FACTORS[block]
    act = dp4a.empty_activations(k, x.device, m) if out is None else out
    bm = rotate_rows_per_program(m) if bm is None else bm
    _rotate_dp4a_kernel[(k // block, triton.cdiv(m, bm))](
        x2, signs, act.xa, act.xr, act.gx, act.gr, act.s, m, k, x2.stride(0), 1.0 / math.sqrt(block), BM=bm, B1=b1,
        B2=b2, SPLIT_X=x.dtype != torch.bfloat16, DT=dot_dtype(), INV127=dp4a.INV127, EARLY_LAUNCH=early_launch(x2),
        num_warps=4, enable_fp_fusion=False)
    return dp4a.made_by(act, dp4a.PREP_ROTATION, bm)


# Where quantize_per_token reads each row whole into one program's registers instead of walking its tiles twice
# (H200, same bits: down_proj's 8704-wide rows 1.8x faster at 16-128 rows, 1.3x at 256, but 0.93x from 288, where
# the programs no longer fit one wave; the 3072- and 5120-wide rows 0.6-0.95x at 64-2048, their walk is only 3-5
# tiles). BK = 16384 at most (32 values per thread at 16 warps).
ONE_PASS_MIN_K = 6144
ONE_PASS_MAX_K = 16384
ONE_PASS_MAX_M = 256


def one_pass_default(m: int, k: int) -> bool:
    """Whether quantize_per_token reads m already rotated rows of width k in one pass by default."""
    return ONE_PASS_MIN_K <= k <= ONE_PASS_MAX_K and m <= ONE_PASS_MAX_M


def quantize_per_token(x: torch.Tensor, signs: torch.Tensor | None = None, block: int = 1024, *,
                       out: tuple[torch.Tensor, torch.Tensor] | None = None, bm: int | None = None,
                       num_warps: int = 4, one_pass: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token int8: (q int8 [M, K], scale float32 [M]) with x_row ≈ q_row · scale.

    With `signs`, x is rotated first (H(s ⊙ x), fused, K % block == 0); without, x is taken as already
    rotated (any K that is a multiple of 128, e.g. down_proj's 8704 per TP=2 rank). `one_pass`: one program per
    row holding the whole row, instead of the tile walk that reads it twice; the same bits (None: without signs
    or `bm`, K from ONE_PASS_MIN_K to ONE_PASS_MAX_K and up to ONE_PASS_MAX_M rows).
    """
    require()
    x2 = _rows(x)
    m, k = x2.shape
    if one_pass is None:
        one_pass = signs is None and bm is None and one_pass_default(m, k)
    if one_pass:
        if signs is not None or k % 128 or k > ONE_PASS_MAX_K:
            raise ValueError(f"quantize_per_token: one_pass takes an already rotated x, K a multiple of 128 up to "
                             f"{ONE_PASS_MAX_K} (got K = {k}, signs {'given' if signs is not None else 'none'})")
    elif signs is not None:
        _check(x2, signs, block)
        b1, b2 = _FACTORS[block]
    else:
        tile = next((t for t in (1024, 512, 256, 128) if k % t == 0), None)
        if tile is None:
            raise ValueError(f"quantize_per_token: width {k} is not a multiple of 128")
        b1, b2 = _TILES[tile]
    q, qs = (torch.empty(m, k, dtype=torch.int8, device=x.device),
             torch.empty(m, dtype=torch.float32, device=x.device)) if out is None else out
    if one_pass:
        bk = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](x2, q, qs, k, x2.stride(0), q.stride(0), BK=bk, num_warps=max(4, bk // 1024))
        return q, qs
    bm = bm or 1  # one row per program: the fastest on the H200 at every M (each program walks its row twice)
    _rotate_quant_kernel[(triton.cdiv(m, bm), 1)](
        x2, x2 if signs is None else signs, x2, q, qs, m, k, x2.stride(0), 0, q.stride(0),
        1.0 / math.sqrt(b1 * b2), BM=bm, B1=b1, B2=b2, ROTATE=signs is not None, QUANT=True, GEMV_ORDER=False,
        SPLIT_X=x.dtype != torch.bfloat16, DT=dot_dtype(), num_warps=num_warps)
    return q, qs


def quantize_per_token_ref(xr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of the int8 step of ternary.reference.ternary_linear_int8_ref, on a rotated x [M, K]."""
    xr = xr.float().reshape(-1, xr.shape[-1])
    scale = xr.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.round(xr / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-127, 127)
    return q.to(torch.int8), scale.reshape(-1)
