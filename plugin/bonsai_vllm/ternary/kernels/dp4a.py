"""The decode GEMV on dp4a for 1 to MAX_ROWS rows (issue 19), with its activation prep and deterministic split-K.

`kernels.linear.route` takes it for M <= linear.DP4A_MAX_M rows by default (BONSAI_DP4A_GEMV=0: the fma
GEMV); `make gpu-check` checks it at every real shape. `benchmarks/dp4a_gemv.py` checks and times it at the
27B's shapes. Two rows are what one user's decode step is with MTP on (the token and its draft).

The served `fma` GEMV spends ~3.3 instructions per weight; here PTX `dp4a` does four weights at once:

- the codes of a word (code i at bits 2i, u = value + 1 in {0, 1, 2}) split into four int32 lanes by
  `(word >> 2j) & 0x03030303`: byte b of lane j is the code of input 16w + 4b + j;
- each activation row is prepared once per call in the same order (`prepare`): per group g of 128 inputs,
  x ≈ s1[g]·x8 + s2[g]·r8, x8 the int8 of x and r8 the int8 of what x8 missed (the residual's second dp4a
  keeps the error far under bf16's), each stored as planar int32 [4, K/16] (lane j, word w: four bytes), plus
  per-group sums X1, X2 of x8, r8 and the scales, all on the device (no host sync: CUDA-graph safe). Scales
  per group, not per row: no reduction across the row, so the prep runs on K/1024 programs at once (one
  program over the whole row cost 3–6 µs on the H200, as much as the GEMV gains);
- per word and row two chains of four dp4a give Σ u·x8 and Σ u·r8 (the lanes of a word are made once for
  all rows); per group of 128 the value sum is Σ u·x − Σ x:
      y[n] = Σ_g scale[n, g] · (s1[g] (T1[n, g] − X1[g]) + s2[g] (T2[n, g] − X2[g]))      in float32;
- split-K (several programs per row tile, for the small-N layers) ends deterministically: each program
  writes its partial sum, and the last one to arrive for a tile (a per-tile counter) adds the partials in
  slice order and writes y, then resets the counter for the next call. No float atomics: the same input
  gives the same bits every call.

References beside the kernels: `prepare_reference` (the same rounding, in torch) and `gemv_reference` (the
integer maths above in torch). Under TRITON_INTERPRET=1 the kernel emulates dp4a with shifts (the
interpreter has no inline PTX), so tests/core/test_dp4a.py runs the same kernel on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from bonsai_vllm.triton_runtime import early_launch, interpreting, require, tl, triton

GROUP = 128  # scale group along K (the checkpoint's)
PREP_DP4A, PREP_ROTATION, PREP_CUDA_ROTATION = "prepare", "rotation", "cuda_rotation"  # Dp4aActivations.prep
PREP_NORM_ROTATION = "norm_rotation"  # rotate_prep.norm_rotate_prep: RMSNorm + rotation + prep, a CTA per block
INV127 = 1.0 / 127  # int8 scale = max |x| · INV127, in float32 on both sides


@dataclass(frozen=True)
class Dp4aActivations:
    """M prepared activation rows of K inputs each, and which kernel prepared them."""

    xa: torch.Tensor  # int32 [M, 4, K/16]: row m, lane j, word w = bytes x8[m, 16w + 4b + j], b = 0..3
    xr: torch.Tensor  # int32 [M, 4, K/16]: the same for r8
    gx: torch.Tensor  # int32 [M, K/128]: Σ x8 per group
    gr: torch.Tensor  # int32 [M, K/128]: Σ r8 per group
    s: torch.Tensor  # float32 [M, 2, K/128]: s1, s2 per group
    # The kernel that wrote them, which the mma kernel's launch rule needs (mma.early_pays: it may start while
    # that kernel runs): PREP_DP4A (`prepare`), PREP_ROTATION (hadamard.rotate_dp4a), PREP_CUDA_ROTATION
    # (rotate_prep.rotate_prep) or PREP_NORM_ROTATION (rotate_prep.norm_rotate_prep), with `prep_rows` rows per
    # program.
    prep: str = PREP_DP4A
    prep_rows: int = 1

    @property
    def rows(self) -> int:
        return self.xa.shape[0]


@dataclass(frozen=True)
class Dp4aConfig:
    bn: int  # rows per program
    bw: int  # words per K step (a multiple of 8: whole scale groups)
    warps: int
    stages: int
    split: int = 1  # slices of K; > 1: partial sums, added by the tile's last program in slice order

    def __str__(self) -> str:
        return f"bn={self.bn} bw={self.bw} warps={self.warps} stages={self.stages} split={self.split}"


# Rows one GEMV call takes (the codes of a word are split into lanes once, then each row's dp4a chains
# run on them); kernels.linear.DP4A_MAX_M says up to which M the route takes it.
MAX_ROWS = 4


def default_config(n: int, k: int, rows: int = 1) -> Dp4aConfig | None:
    """The configuration for `rows` rows through a layer of N outputs and K inputs, None where the kernel
    does not apply. One row, from the H200 sweep of benchmarks/dp4a_gemv.py (docs/benchmarks.md): BN = BW =
    32, two warps at every shape; four K slices for the wide layers, eight for the 5120-row ones (stages 2
    and 3 within run spread). Two rows: the fastest of the H200 sweep for each shape class (docs/benchmarks.md).
    More rows hold rows × BN × BW partial sums, so BN halves from three rows (not dispatched: slower than the
    tensor-core GEMV there)."""
    if k % GROUP or (k // 16) % 32 or not 1 <= rows <= MAX_ROWS:
        return None
    if rows == 1:
        return Dp4aConfig(bn=32, bw=32, warps=2, stages=2, split=4 if n > 6144 else 8)
    if rows == 2:  # the fastest of the two-row sweep per shape class
        if n > 65536:  # the LM head: enough tiles without many slices
            return Dp4aConfig(bn=32, bw=32, warps=1, stages=2, split=2)
        if k > 6144:  # down_proj's 8704 inputs per rank
            return Dp4aConfig(bn=32, bw=32, warps=1, stages=2, split=8)
        if k >= 4096 and n <= 8192:  # qkv, GDN-in: 5120 inputs, 7168-8192 outputs
            return Dp4aConfig(bn=16, bw=32, warps=1, stages=2, split=4)
        return Dp4aConfig(bn=32, bw=32, warps=4, stages=2, split=4)  # gate_up, o_proj, GDN-out
    return Dp4aConfig(bn=16, bw=32, warps=4, stages=2, split=4)


def _round(v: torch.Tensor) -> torch.Tensor:
    # Half away from zero, as the kernel does it (floor(|v| + 0.5) with the sign): both must agree bit for bit.
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def prepare_reference(x: torch.Tensor) -> Dp4aActivations:
    """x [K] or [M, K] (float) -> Dp4aActivations, in torch."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = [_prepare_row_reference(row) for row in x2]
    return Dp4aActivations(*(torch.stack([getattr(r, f) for r in rows]) for f in ("xa", "xr", "gx", "gr", "s")))


def _prepare_row_reference(x: torch.Tensor) -> Dp4aActivations:
    """One row x [K] -> its tensors without the rows dimension ([4, K/16], [K/128], [2, K/128])."""
    x = x.float()
    k = x.numel()
    xg = x.view(-1, GROUP)  # [G, 128]
    s1 = xg.abs().amax(1, keepdim=True).clamp_min(1e-30) * INV127
    x8 = _round(xg * (1.0 / s1)).clamp(-127, 127)
    r = xg - x8 * s1
    s2 = r.abs().amax(1, keepdim=True).clamp_min(1e-30) * INV127
    r8 = _round(r * (1.0 / s2)).clamp(-127, 127)
    x8, r8 = x8.reshape(-1), r8.reshape(-1)

    def planar(q: torch.Tensor) -> torch.Tensor:
        b = q.to(torch.int8).view(k // 16, 4, 4).transpose(1, 2).contiguous()  # [w, j, b]
        return b.view(torch.int32).view(k // 16, 4).t().contiguous()  # [4, w]

    return Dp4aActivations(planar(x8), planar(r8), x8.view(-1, GROUP).sum(1).to(torch.int32),
                           r8.view(-1, GROUP).sum(1).to(torch.int32), torch.stack([s1[:, 0], s2[:, 0]]).float())


def gemv_reference(act: Dp4aActivations, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's maths in torch: packed int32 [N, K/16], scales [N, K/128] -> y float32 [M, N]."""
    return torch.stack([_gemv_row_reference(act.xa[m], act.xr[m], act.gx[m], act.gr[m], act.s[m], packed, scales)
                        for m in range(act.rows)])


def unplanar(p: torch.Tensor) -> torch.Tensor:
    """Planar activation bytes [..., 4, K/16] int32 -> the int8 values [..., K] in input order (int64)."""
    kw = p.shape[-1]
    b = p.transpose(-1, -2).contiguous().view(torch.int8).view(*p.shape[:-2], kw, 4, 4).transpose(-1, -2)  # [w, b, j]
    return b.reshape(*p.shape[:-2], kw * 16).to(torch.int64)


def _gemv_row_reference(xa, xr, gx, gr, sg, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, kw = packed.shape
    shifts = torch.arange(16, device=packed.device, dtype=torch.int32) * 2
    u = ((packed.unsqueeze(-1) >> shifts) & 3).reshape(n, kw * 16).to(torch.int64)  # [N, K] codes, k = 16w + i
    x8, r8 = unplanar(xa), unplanar(xr)
    t1 = (u * x8).view(n, -1, GROUP).sum(-1)  # [N, G]
    t2 = (u * r8).view(n, -1, GROUP).sum(-1)
    s1, s2 = sg[0], sg[1]  # [G]
    v = s1 * (t1 - gx.to(torch.int64)).float() + s2 * (t2 - gr.to(torch.int64)).float()
    return (scales.float() * v).sum(-1)


if triton is not None:
    from bonsai_vllm.triton_runtime import launch_dependents

    @triton.jit
    def _dp4a(a, b, c, USE_ASM: tl.constexpr):
        # c + Σ_bytes sext(a_b) · sext(b_b): one PTX instruction on the GPU, shifts in the interpreter.
        if USE_ASM:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            out = c
            for i in tl.static_range(4):
                out += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
            return out

    @triton.jit
    def _round_int8(v):
        return tl.minimum(tl.maximum(tl.where(v < 0, -tl.floor(-v + 0.5), tl.floor(v + 0.5)), -127.0), 127.0)

    @triton.jit
    def _prepare_groups(x, row0, M, g0, K, xa_ptr, xr_ptr, gx_ptr, gr_ptr, s_ptr, R: tl.constexpr, GB: tl.constexpr,
                        INV127: tl.constexpr):
        """Prepare groups [g0, g0 + GB) of rows [row0, row0 + R) (rows from M on skipped) from x float32
        [R · GB, 128] (row-major over (row, group), each group's inputs in natural order): stores their bytes,
        sums and scales (see Dp4aActivations). Shared by _prepare_kernel and the rotation kernel that prepares
        straight from its float32 result (hadamard._rotate_dp4a_kernel)."""
        G = K // 128
        RG: tl.constexpr = R * GB
        gi = tl.arange(0, RG)
        row = row0 + gi // GB
        rg = g0 + gi % GB
        gmask = (rg < G) & (row < M)
        # The same float32 operations as prepare_reference, so both agree bit for bit on any device: the
        # scale as a product with the float32 of 1/127 (torch on CUDA divides by a scalar that way), one
        # IEEE-rounded reciprocal per group (div_rn; Triton's default division is approximate), then
        # products only, per input (the launch turns FMA contraction off: x − x8·s1 is rounded twice).
        s1 = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30) * INV127  # [RG]
        x8 = _round_int8(x * tl.math.div_rn(tl.full([RG], 1.0, tl.float32), s1)[:, None])
        r = x - x8 * s1[:, None]
        s2 = tl.maximum(tl.max(tl.abs(r), axis=1), 1e-30) * INV127
        r8 = _round_int8(r * tl.math.div_rn(tl.full([RG], 1.0, tl.float32), s2)[:, None])
        q1 = x8.to(tl.int32)
        q2 = r8.to(tl.int32)
        tl.store(gx_ptr + row * G + rg, tl.sum(q1, axis=1), mask=gmask)
        tl.store(gr_ptr + row * G + rg, tl.sum(q2, axis=1), mask=gmask)
        tl.store(s_ptr + row * (2 * G) + rg, s1, mask=gmask)
        tl.store(s_ptr + row * (2 * G) + G + rg, s2, mask=gmask)
        # planar bytes: input 16w + 4b + j -> word w of lane j, byte b. [RG·8 words, 4 (b), 4 (j)], summed over b.
        WB: tl.constexpr = RG * 8
        shift = (tl.arange(0, 4) * 8)[None, :, None]
        p1 = tl.sum(tl.reshape(q1 & 0xFF, (WB, 4, 4)) << shift, axis=1)  # [WB, 4 (j)]
        p2 = tl.sum(tl.reshape(q2 & 0xFF, (WB, 4, 4)) << shift, axis=1)
        wi = tl.arange(0, WB)
        wrow = row0 + wi // (GB * 8)
        rw = g0 * 8 + wi % (GB * 8)  # the word within its row
        offs = wrow[:, None] * (K // 4) + tl.arange(0, 4)[None, :] * (K // 16) + rw[:, None]
        wmask = ((rw < K // 16) & (wrow < M))[:, None]
        tl.store(xa_ptr + offs, p1, mask=wmask)
        tl.store(xr_ptr + offs, p2, mask=wmask)

    @triton.jit
    def _prepare_kernel(x_ptr, xa_ptr, xr_ptr, gx_ptr, gr_ptr, s_ptr, K, stride_x, GB: tl.constexpr,
                        INV127: tl.constexpr, EARLY_LAUNCH: tl.constexpr):
        # grid: (cdiv(K / 128, GB), M). Program (p, m) prepares groups [p·GB, (p+1)·GB) of row m: x as [GB, 128],
        # one scale pair each. The GEMV after it (a programmatic dependent) may start streaming its codes now.
        launch_dependents(EARLY_LAUNCH)
        m = tl.program_id(1)
        rg = tl.program_id(0) * GB + tl.arange(0, GB)
        ri = tl.arange(0, 128)
        x = tl.load(x_ptr + m * stride_x + rg[:, None] * 128 + ri[None, :], mask=(rg < K // 128)[:, None], other=0.0)
        _prepare_groups(x.to(tl.float32), m, m + 1, tl.program_id(0) * GB, K, xa_ptr, xr_ptr, gx_ptr, gr_ptr, s_ptr,
                        1, GB, INV127)

    @triton.jit
    def _gemv_kernel(w_ptr, sc_ptr, xa_ptr, xr_ptr, gx_ptr, gr_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, N, KW, CHUNK,
                     SPLITS, BN: tl.constexpr, BW: tl.constexpr, USE_ASM: tl.constexpr):
        # grid: (cdiv(N, BN), SPLITS). Program (t, s) walks words [s·CHUNK, (s+1)·CHUNK) of K for BN rows, BW
        # words (BW / 8 groups) per step.
        G8: tl.constexpr = BW // 8
        tile = tl.program_id(0)
        part = tl.program_id(1)
        rn = tile * BN + tl.arange(0, BN)
        nmask = rn < N
        rw = tl.arange(0, BW)
        rg = tl.arange(0, G8)
        acc = tl.zeros([BN], dtype=tl.float32)
        zero = tl.zeros([BN, BW], dtype=tl.int32)
        G = KW // 8
        k0 = part * CHUNK
        for w0 in range(k0, min(k0 + CHUNK, KW), BW):
            p = tl.load(w_ptr + rn[:, None] * KW + w0 + rw[None, :], mask=nmask[:, None], other=0)  # [BN, BW]
            t1 = zero
            t2 = zero
            for j in tl.static_range(4):
                c = (p >> (2 * j)) & 0x03030303
                xa = tl.load(xa_ptr + j * KW + w0 + rw)[None, :]
                xr = tl.load(xr_ptr + j * KW + w0 + rw)[None, :]
                t1 = _dp4a(c, xa, t1, USE_ASM)
                t2 = _dp4a(c, xr, t2, USE_ASM)
            g0 = w0 // 8
            T1 = tl.sum(tl.reshape(t1, (BN, G8, 8)), axis=2)  # [BN, G8] Σ u·x8 per group
            T2 = tl.sum(tl.reshape(t2, (BN, G8, 8)), axis=2)
            X1 = tl.load(gx_ptr + g0 + rg)[None, :]
            X2 = tl.load(gr_ptr + g0 + rg)[None, :]
            s1 = tl.load(s_ptr + g0 + rg)[None, :]
            s2 = tl.load(s_ptr + G + g0 + rg)[None, :]
            sc = tl.load(sc_ptr + rn[:, None] * G + g0 + rg[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
            v = s1 * (T1 - X1).to(tl.float32) + s2 * (T2 - X2).to(tl.float32)
            acc += tl.sum(sc * v, axis=1)
        if SPLITS == 1:
            tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=nmask)
        else:
            tl.store(ws_ptr + part * N + rn, acc, mask=nmask)
            tl.debug_barrier()  # every thread's partial is written before the program announces it
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLITS - 1:  # the last slice of this tile: add them all, in slice order
                total = tl.zeros([BN], dtype=tl.float32)
                for s in range(0, SPLITS):
                    total += tl.load(ws_ptr + s * N + rn, mask=nmask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + rn, total.to(y_ptr.dtype.element_ty), mask=nmask)
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call (CUDA-graph replays too)

    @triton.jit
    def _gemv_rows_kernel(w_ptr, sc_ptr, xa_ptr, xr_ptr, gx_ptr, gr_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, N, KW,
                          CHUNK, SPLITS, stride_y, ROWS: tl.constexpr, RP: tl.constexpr, BN: tl.constexpr,
                          BW: tl.constexpr, USE_ASM: tl.constexpr):
        # _gemv_kernel for ROWS >= 2 rows (one user's decode step with MTP is two): the same walk, the rows a
        # third tile dimension, and a word's codes split into lanes once for all rows' dp4a chains. Kept
        # apart from the one-row kernel: the 3-D form ran one row at 20.5 µs against 12.5 (gate_up, H200).
        # RP: ROWS rounded up to a power of two (Triton's tile sizes); the padding rows read zeros and are
        # never stored.
        G8: tl.constexpr = BW // 8
        tile = tl.program_id(0)
        part = tl.program_id(1)
        rn = tile * BN + tl.arange(0, BN)
        nmask = rn < N
        rw = tl.arange(0, BW)
        rg = tl.arange(0, G8)
        rr = tl.arange(0, RP)
        rmask = rr < ROWS
        acc = tl.zeros([RP, BN], dtype=tl.float32)
        zero = tl.zeros([RP, BN, BW], dtype=tl.int32)
        G = KW // 8
        k0 = part * CHUNK
        for w0 in range(k0, min(k0 + CHUNK, KW), BW):
            p = tl.load(w_ptr + rn[:, None] * KW + w0 + rw[None, :], mask=nmask[:, None], other=0)  # [BN, BW]
            t1 = zero
            t2 = zero
            for j in tl.static_range(4):
                c = tl.broadcast_to(((p >> (2 * j)) & 0x03030303)[None, :, :], (RP, BN, BW))
                lane = rr[:, None] * (4 * KW) + j * KW + w0 + rw[None, :]  # [RP, BW]
                xa = tl.broadcast_to(tl.load(xa_ptr + lane, mask=rmask[:, None], other=0)[:, None, :], (RP, BN, BW))
                xr = tl.broadcast_to(tl.load(xr_ptr + lane, mask=rmask[:, None], other=0)[:, None, :], (RP, BN, BW))
                t1 = _dp4a(c, xa, t1, USE_ASM)
                t2 = _dp4a(c, xr, t2, USE_ASM)
            g0 = w0 // 8
            T1 = tl.sum(tl.reshape(t1, (RP, BN, G8, 8)), axis=3)  # [RP, BN, G8] Σ u·x8 per group
            T2 = tl.sum(tl.reshape(t2, (RP, BN, G8, 8)), axis=3)
            gmask = rmask[:, None, None]
            grp = (rr[:, None] * G + g0 + rg[None, :])[:, None, :]  # [RP, 1, G8]
            X1 = tl.load(gx_ptr + grp, mask=gmask, other=0)
            X2 = tl.load(gr_ptr + grp, mask=gmask, other=0)
            sgrp = (rr[:, None] * (2 * G) + g0 + rg[None, :])[:, None, :]
            s1 = tl.load(s_ptr + sgrp, mask=gmask, other=0.0)
            s2 = tl.load(s_ptr + G + sgrp, mask=gmask, other=0.0)
            sc = tl.load(sc_ptr + rn[:, None] * G + g0 + rg[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
            v = s1 * (T1 - X1).to(tl.float32) + s2 * (T2 - X2).to(tl.float32)
            acc += tl.sum(sc[None, :, :] * v, axis=2)
        out = rr[:, None] * stride_y + rn[None, :]
        omask = nmask[None, :] & rmask[:, None]
        if SPLITS == 1:
            tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=omask)
        else:
            mine = part * (ROWS * N) + rr[:, None] * N + rn[None, :]
            tl.store(ws_ptr + mine, acc, mask=omask)
            tl.debug_barrier()  # every thread's partial is written before the program announces it
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLITS - 1:  # the last slice of this tile: add them all, in slice order
                total = tl.zeros([RP, BN], dtype=tl.float32)
                for sl in range(0, SPLITS):
                    total += tl.load(ws_ptr + sl * (ROWS * N) + rr[:, None] * N + rn[None, :], mask=omask,
                                     other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + out, total.to(y_ptr.dtype.element_ty), mask=omask)
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call (CUDA-graph replays too)


def empty_activations(k: int, device: torch.device | str, rows: int = 1) -> Dp4aActivations:
    """Uninitialised buffers for `rows` prepared rows of K inputs."""
    return Dp4aActivations(torch.empty(rows, 4, k // 16, dtype=torch.int32, device=device),
                           torch.empty(rows, 4, k // 16, dtype=torch.int32, device=device),
                           torch.empty(rows, k // GROUP, dtype=torch.int32, device=device),
                           torch.empty(rows, k // GROUP, dtype=torch.int32, device=device),
                           torch.empty(rows, 2, k // GROUP, dtype=torch.float32, device=device))


def prepare(x: torch.Tensor, out: Dp4aActivations | None = None) -> Dp4aActivations:
    """x [K] or [M, K] (bf16/fp32, on the kernel's device) -> Dp4aActivations of M rows, one launch."""
    require()
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    if k % GROUP:
        raise ValueError(f"dp4a.prepare: K = {k} is not a multiple of the scale group {GROUP}")
    if out is None:
        out = empty_activations(k, x.device, m)
    gb = 8  # groups per program: 1024 inputs
    _prepare_kernel[(triton.cdiv(k // GROUP, gb), m)](x2, out.xa, out.xr, out.gx, out.gr, out.s, k, x2.stride(0),
                                                      GB=gb, INV127=INV127, EARLY_LAUNCH=early_launch(x2), num_warps=4,
                                                      # x − x8·s1 rounded twice, as torch does: no FMA
                                                      enable_fp_fusion=False)
    return made_by(out, PREP_DP4A, 1)


def made_by(act: Dp4aActivations, prep: str, rows: int) -> Dp4aActivations:
    """`act` marked as written by the kernel `prep` with `rows` rows per program (a caller's `out` buffers may
    last have been written by another)."""
    return act if (act.prep, act.prep_rows) == (prep, rows) else replace(act, prep=prep, prep_rows=rows)


class Dp4aWorkspace:
    """Partial sums and per-tile counters of split-K, kept between calls (counters are reset by the kernel)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.partials = torch.empty(0, dtype=torch.float32, device=self.device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=self.device)

    def get(self, n_partials: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.partials.numel() < n_partials:
            self.partials = torch.empty(n_partials, dtype=torch.float32, device=self.device)
        if self.counters.numel() < n_tiles:
            self.counters = torch.zeros(n_tiles, dtype=torch.int32, device=self.device)
        return self.partials, self.counters


_SHARED: dict[torch.device, Dp4aWorkspace] = {}


def shared_workspace(device: torch.device | str) -> Dp4aWorkspace:
    """One workspace per device for every layer: the layers run one after another on one stream, and each
    call leaves the counters at zero (the same rule as gemv.py's split-K fixup)."""
    device = torch.device(device)
    return _SHARED.setdefault(device, Dp4aWorkspace(device))


def _slices(kw: int, config: Dp4aConfig) -> tuple[int, int]:
    """(words per K slice, number of slices): `config.split` slices of whole BW steps, fewer when K is short."""
    chunk = triton.cdiv(triton.cdiv(kw, config.bw), config.split) * config.bw
    return chunk, triton.cdiv(kw, chunk)


def reserve(device: torch.device | str, n: int, config: Dp4aConfig, kw: int, rows: int = 1) -> None:
    """Grow the shared workspace for a layer's calls of up to `rows` rows at load time, so that no call (nor
    a CUDA-graph capture) allocates it."""
    _, splits = _slices(kw, config)
    shared_workspace(device).get(splits * rows * n, triton.cdiv(n, config.bn))


def gemv(act: Dp4aActivations, packed: torch.Tensor, scales: torch.Tensor, config: Dp4aConfig,
         workspace: Dp4aWorkspace, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] (float32 unless `out` says otherwise) = the ternary layer (packed int32 [N, K/16], scales
    [N, K/128]) applied to the M rows of `act`; `out` may be any [M, N] view with unit stride along N."""
    require()
    n, kw = packed.shape
    rows = act.rows
    if kw % config.bw:
        raise ValueError(f"dp4a.gemv: K/16 = {kw} is not a multiple of BW = {config.bw}")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"dp4a.gemv: {rows} rows; the kernel takes 1 to {MAX_ROWS}")
    chunk, splits = _slices(kw, config)
    tiles = triton.cdiv(n, config.bn)
    y = torch.empty(rows, n, dtype=torch.float32, device=packed.device) if out is None else out.view(rows, n)
    partials, counters = workspace.get(splits * rows * n if splits > 1 else 1, tiles)
    if rows == 1:
        _gemv_kernel[(tiles, splits)](packed, scales, act.xa, act.xr, act.gx, act.gr, act.s, y, partials, counters,
                                      n, kw, chunk, splits, BN=config.bn, BW=config.bw, USE_ASM=not interpreting(),
                                      num_warps=config.warps, num_stages=config.stages)
    else:
        _gemv_rows_kernel[(tiles, splits)](packed, scales, act.xa, act.xr, act.gx, act.gr, act.s, y, partials,
                                           counters, n, kw, chunk, splits, y.stride(0), ROWS=rows,
                                           RP=triton.next_power_of_2(rows), BN=config.bn, BW=config.bw,
                                           USE_ASM=not interpreting(), num_warps=config.warps,
                                           num_stages=config.stages)
    return y
