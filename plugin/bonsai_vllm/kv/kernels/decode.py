"""Decode attention over the quantized pages + the bf16 recent window, all query heads of a KV head at once.

Reference (the judge): `reference.decode_ref` (dequantize everything, attend in float64, merge the two
parts by log-sum-exp).

Why grouped. Under GQA 6:1 one KV head serves 6 query heads. A kernel with one program per query head
(what vLLM's TurboQuant decode and the OSCAR PR do) reads and unpacks every KV tile 6 times; here one
program takes a head tile of HT query heads (HT = group = 6: all of them) × QL query positions as the
rows of a tensor-core product, so each tile of codes is read and unpacked once. The same kernel with
HT = 1 (`heads_per_program=1`) is the one-program-per-query-head baseline the benchmark compares against.

The GQA trap (docs/design.md §1): the program for head tile t reads KV head (t·HT) // group, which is right for
every row only if HT divides the group. `decode` refuses other tiles; `heads_per_program`
(with `_unsafe=True`) exists so a test can show that the comparison with the reference catches it.

Flash-decoding split. Programs are (sequence, head tile, split): splits 0 … S-1 each take one contiguous
chunk of the quantized tokens, split S takes the bf16 window; each writes a partial output and its
log2-sum-exp; `_merge_kernel` combines the S+1 parts. S is fixed per launch (CUDA-graph friendly); the
chunk of each sequence is its own token count / S rounded up to BLOCK_N, which divides the page size,
so a tile never straddles a page.

Scores without dequantizing. k̂ = c·s + m per token, so q·k̂ = s·(q·c) + m·Σq: the product runs on the
raw codes and the scale and min are applied per token afterwards (the same for p·v̂ = (p·s)·c + Σ p·m).

Unpacking (format.py's planar pieces: dim P·i + j at bits 2i of byte j, P = D/4): no shift, no
conversion. (byte & (3 << 2i)) is c·4^i < 1024, and the same bits read as an fp16 are the subnormal
c·4^i·2^-24, exact; the factor is folded into the query (q·4^-i, exact) and into the final output
(·2^24·4^-i). The third key bit gets its own products (dims P·i + [0, P/2) against bit 2i, the rest
against bit 2i + 1, each half a K = 32 product with a query half pre-scaled by the bit's power of two):
only ANDs before the products, the byte tiles go to the operand layout directly. Relies on the tensor
cores taking fp16 subnormals as they are: checked against the reference on the H200 (bench_kv). K tiles
are loaded transposed ([dims, tokens]: the B operand of q·kᵀ as consumed), V tiles as they are. The
alternatives it was measured against (integer-to-fp16 conversion of shifted codes, which issues at a quarter
of the integer rate on Hopper; the third key bit shifted beside the low two; independent per-piece product
chains, which spilled) were about 2× slower or spilled, and are gone: figures in docs/kv-cache.md and
docs/benchmarks.md (`make bench-kv`).

Accumulating. v̂ = c·s + m with codes c ∈ {0 … 3}: Σ p·s·c carries an offset of about 1.5·s·Σp per
dimension that the min term Σ p·m cancels, so with diffuse attention over a long split the two are far
larger than the output (randn data: ~2.3 against ~1/√(tokens)). The tensor cores add each product to the
float32 accumulator truncated toward zero at 2^-2 ulp of the largest term (measured on the H200: products
under a quarter ulp of the accumulator vanish; tests/core/tensor_cores.py models it), so a split of tens of
thousands of tokens loses a few 1e-4 of that offset, which is far more than the output's own error (the
figures before and after this fix: docs/kv-cache.md). So each tile's product starts from zero, and the
codes' mean 3/2 is taken out (Σ pv·(c − 3/2) = tile − 3/2·Σ pv, the offset added to the min term) before
the tile joins the accumulator. Centring the codes before the products instead (exact fp16 arithmetic on
the bits) was as accurate and slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bonsai_vllm.triton_runtime import require, tl, triton
from bonsai_vllm.kv.format import KVFormat
from bonsai_vllm.kv.reference import LOG2E

if triton is not None:

    @triton.jit
    def _codes(b, i: tl.constexpr):
        """Two-bit codes of piece i of bytes b (K's low bits or V) as fp16, unshifted: (b & (3 << 2i)) is
        c·4^i < 1024, and the same bits read as an fp16 are the subnormal c·4^i·2^-24, exact (the factor is
        taken out in the query and the output; see the module docstring)."""
        return (b & (3 << (2 * i))).to(tl.int16).to(tl.float16, bitcast=True)

    @triton.jit
    def _hbits(hi, bit: tl.constexpr):
        """One bit plane of the third key bits, [W, N], as subnormal fp16 (bit value 2^bit · 2^-24)."""
        return (hi & (1 << bit)).to(tl.int16).to(tl.float16, bitcast=True)

    @triton.jit
    def _online(s, m_i, l_i):
        """One step of online softmax in base 2 on scores s [R, N] (masked entries -inf)."""
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)

    @triton.jit(do_not_specialize=["NUM_SPLITS", "Q_START"])
    def _decode_kernel(q_ptr, cache_ptr, bt_ptr, nq_ptr, wk_ptr, wv_ptr, nw_ptr, po_ptr, pl_ptr, qk_scale, NUM_SPLITS, Q_START,
                       stride_qb, stride_qt, stride_qh, stride_cb, stride_ch, stride_btb,
                       stride_wb, stride_wh, stride_wt, stride_pb, stride_pt, stride_ph, stride_ps,
                       stride_lb, stride_lt, stride_lh, BS: tl.constexpr, D: tl.constexpr, QL: tl.constexpr,
                       HT: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, K_BITS: tl.constexpr,
                       OFF_HI: tl.constexpr, OFF_V: tl.constexpr, OFF_META: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
        # grid: (B, Hq / HT, NUM_SPLITS + 1). Rows r of a program: query position r // HT, head h0 + r % HT.
        P: tl.constexpr = D // 4
        W: tl.constexpr = D // 8
        b = tl.program_id(0)
        h0 = tl.program_id(1) * HT
        split = tl.program_id(2)
        kvh = h0 // GROUP  # right for every row only when HT divides GROUP (see module docstring)
        r = tl.arange(0, ROWS)
        qpos = r // HT
        head = h0 + r % HT
        rmask = r < QL * HT
        j = tl.arange(0, P)
        q_rows = q_ptr + b * stride_qb + qpos[:, None] * stride_qt + head[:, None] * stride_qh + j[None, :]

        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        pm = tl.zeros([ROWS], tl.float32)  # Σ p · v_min (quantized part)
        acc0 = tl.zeros([ROWS, P], tl.float32)
        acc1 = tl.zeros([ROWS, P], tl.float32)
        acc2 = tl.zeros([ROWS, P], tl.float32)
        acc3 = tl.zeros([ROWS, P], tl.float32)

        if split < NUM_SPLITS:
            # ---- quantized pages: tokens [start, end) of this sequence
            n = tl.load(nq_ptr + b)
            chunk = tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
            start = split * chunk
            end = tl.minimum(start + chunk, n)
            # q pieces, scaled to log2 units, with the 4^-i of the unshifted codes folded in.
            q0 = tl.load(q_rows, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
            q1 = tl.load(q_rows + P, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
            q2 = tl.load(q_rows + 2 * P, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
            q3 = tl.load(q_rows + 3 * P, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
            q1 = q1 * 0.25
            q2 = q2 * 0.0625
            q3 = q3 * 0.015625
            if K_BITS == 3:
                # query halves for the third-bit products: dims P·i + [0, W) meet bit 2i (value 2^2i),
                # dims P·i + [W, P) meet bit 2i + 1; scaled so that both give 4·c_hi·q (exact powers of 2)
                jw = tl.arange(0, W)
                qa_rows = q_ptr + b * stride_qb + qpos[:, None] * stride_qt + head[:, None] * stride_qh + jw[None, :]
                ha0 = (tl.load(qa_rows, mask=rmask[:, None], other=0.0) * (qk_scale * 4.0)).to(tl.float16)
                hb0 = (tl.load(qa_rows + W, mask=rmask[:, None], other=0.0) * (qk_scale * 2.0)).to(tl.float16)
                ha1 = (tl.load(qa_rows + P, mask=rmask[:, None], other=0.0) * (qk_scale * 1.0)).to(tl.float16)
                hb1 = (tl.load(qa_rows + P + W, mask=rmask[:, None], other=0.0) * (qk_scale * 0.5)).to(tl.float16)
                ha2 = (tl.load(qa_rows + 2 * P, mask=rmask[:, None], other=0.0) * (qk_scale * 0.25)).to(tl.float16)
                hb2 = (tl.load(qa_rows + 2 * P + W, mask=rmask[:, None], other=0.0) * (qk_scale * 0.125)).to(tl.float16)
                ha3 = (tl.load(qa_rows + 3 * P, mask=rmask[:, None], other=0.0) * (qk_scale * 0.0625)).to(tl.float16)
                hb3 = (tl.load(qa_rows + 3 * P + W, mask=rmask[:, None], other=0.0) * (qk_scale * 0.03125)).to(tl.float16)
            q0 = q0.to(tl.float16)
            q1 = q1.to(tl.float16)
            q2 = q2.to(tl.float16)
            q3 = q3.to(tl.float16)
            # Σ_d q_d of the effective (fp16) query, for the min term m · Σq
            qsum = tl.sum(q0.to(tl.float32), axis=1) + tl.sum(q1.to(tl.float32), axis=1) * 4.0 \
                + tl.sum(q2.to(tl.float32), axis=1) * 16.0 \
                + tl.sum(q3.to(tl.float32), axis=1) * 64.0
            CF: tl.constexpr = 16777216.0  # 2^24 for subnormal codes
            # value pieces i: the subnormal codes are c · 4^i · 2^-24
            VF0: tl.constexpr = CF
            VF1: tl.constexpr = 4194304.0
            VF2: tl.constexpr = 1048576.0
            VF3: tl.constexpr = 262144.0
            for t0 in range(start, end, BLOCK_N):
                pg = tl.load(bt_ptr + b * stride_btb + t0 // BS).to(tl.int64)
                base = cache_ptr + pg * stride_cb + kvh * stride_ch
                off = t0 % BS + tl.arange(0, BLOCK_N)
                tok = t0 + tl.arange(0, BLOCK_N)
                tm = (tok < end) & (tok >= Q_START)  # pages before Q_START hold the bf16 sinks' tokens
                # K bytes as [P, BLOCK_N] (dims × tokens): the B operand of q · kᵀ as it is consumed, so the
                # compiler keeps the raw bytes in the operand layout and unpacks them there
                lo = tl.load(base + off[None, :] * P + j[:, None], mask=tm[None, :], other=0).to(tl.int32)
                if K_BITS == 3:
                    jw2 = tl.arange(0, W)
                    hi = tl.load(base + OFF_HI + off[None, :] * W + jw2[:, None], mask=tm[None, :], other=0).to(tl.int32)
                mp = (base + OFF_META + off * 8).to(tl.pointer_type(tl.float16))
                ks = tl.load(mp, mask=tm, other=0.0).to(tl.float32) * CF
                km = tl.load(mp + 1, mask=tm, other=0.0).to(tl.float32)
                vs = tl.load(mp + 2, mask=tm, other=0.0).to(tl.float32)
                vm = tl.load(mp + 3, mask=tm, other=0.0).to(tl.float32)

                s = tl.dot(q0, _codes(lo, 0))
                s = tl.dot(q1, _codes(lo, 1), s)
                s = tl.dot(q2, _codes(lo, 2), s)
                s = tl.dot(q3, _codes(lo, 3), s)
                if K_BITS == 3:
                    s = tl.dot(ha0, _hbits(hi, 0), s)
                    s = tl.dot(hb0, _hbits(hi, 1), s)
                    s = tl.dot(ha1, _hbits(hi, 2), s)
                    s = tl.dot(hb1, _hbits(hi, 3), s)
                    s = tl.dot(ha2, _hbits(hi, 4), s)
                    s = tl.dot(hb2, _hbits(hi, 5), s)
                    s = tl.dot(ha3, _hbits(hi, 6), s)
                    s = tl.dot(hb3, _hbits(hi, 7), s)
                s = s * ks[None, :] + qsum[:, None] * km[None, :]
                s = tl.where(tm[None, :], s, float("-inf"))
                p, alpha, m_i, l_i = _online(s, m_i, l_i)
                pv = (p * vs[None, :]).to(tl.float16)
                vv = tl.load(base + OFF_V + off[:, None] * P + j[None, :], mask=tm[:, None], other=0).to(tl.int32)
                # Σ p·v̂ = Σ pv·(c − 3/2) + Σ (p·vm + 3/2·pv): each tile's product starts from zero and is
                # centred before it joins the float32 accumulator, so the accumulator never holds the codes'
                # offset (≈ |vm|, far larger than the output at long diffuse context; see "Accumulating")
                pvf = pv.to(tl.float32)
                c15 = 1.5 * tl.sum(pvf, axis=1)[:, None]
                pm = pm * alpha + tl.sum(p * vm[None, :] + 1.5 * pvf, axis=1)
                acc0 = acc0 * alpha[:, None] + (tl.dot(pv, _codes(vv, 0)) * VF0 - c15)
                acc1 = acc1 * alpha[:, None] + (tl.dot(pv, _codes(vv, 1)) * VF1 - c15)
                acc2 = acc2 * alpha[:, None] + (tl.dot(pv, _codes(vv, 2)) * VF2 - c15)
                acc3 = acc3 * alpha[:, None] + (tl.dot(pv, _codes(vv, 3)) * VF3 - c15)
            acc0 += pm[:, None]
            acc1 += pm[:, None]
            acc2 += pm[:, None]
            acc3 += pm[:, None]
        else:
            # ---- bf16 recent window (rotated K/V), causal among the QL verify rows
            nw = tl.load(nw_ptr + b)
            q0 = (tl.load(q_rows, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
            q1 = (tl.load(q_rows + P, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
            q2 = (tl.load(q_rows + 2 * P, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
            q3 = (tl.load(q_rows + 3 * P, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
            lim = nw - (QL - 1 - qpos)  # [ROWS]: row sees window tokens < lim
            wbase = b.to(tl.int64) * stride_wb + kvh * stride_wh
            for w0 in tl.range(0, nw, BLOCK_W, num_stages=1):  # small: no multi-buffering (shared memory)
                w = w0 + tl.arange(0, BLOCK_W)
                wm = w < nw
                kp = wk_ptr + wbase + w[:, None] * stride_wt + j[None, :]
                s = tl.dot(q0, tl.trans(tl.load(kp, mask=wm[:, None], other=0.0).to(tl.float16)))
                s = tl.dot(q1, tl.trans(tl.load(kp + P, mask=wm[:, None], other=0.0).to(tl.float16)), s)
                s = tl.dot(q2, tl.trans(tl.load(kp + 2 * P, mask=wm[:, None], other=0.0).to(tl.float16)), s)
                s = tl.dot(q3, tl.trans(tl.load(kp + 3 * P, mask=wm[:, None], other=0.0).to(tl.float16)), s)
                s = tl.where(w[None, :] < lim[:, None], s, float("-inf"))
                p, alpha, m_i, l_i = _online(s, m_i, l_i)
                p16 = p.to(tl.float16)
                vp = wv_ptr + wbase + w[:, None] * stride_wt + j[None, :]
                acc0 = tl.dot(p16, tl.load(vp, mask=wm[:, None], other=0.0).to(tl.float16), acc0 * alpha[:, None])
                acc1 = tl.dot(p16, tl.load(vp + P, mask=wm[:, None], other=0.0).to(tl.float16), acc1 * alpha[:, None])
                acc2 = tl.dot(p16, tl.load(vp + 2 * P, mask=wm[:, None], other=0.0).to(tl.float16), acc2 * alpha[:, None])
                acc3 = tl.dot(p16, tl.load(vp + 3 * P, mask=wm[:, None], other=0.0).to(tl.float16), acc3 * alpha[:, None])

        # ---- this part's normalized output and its log2-sum-exp (-inf and 0 when it saw no token)
        has = l_i > 0
        inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        o_rows = po_ptr + b * stride_pb + qpos[:, None] * stride_pt + head[:, None] * stride_ph \
            + split * stride_ps + j[None, :]
        tl.store(o_rows, acc0 * inv[:, None], mask=rmask[:, None])
        tl.store(o_rows + P, acc1 * inv[:, None], mask=rmask[:, None])
        tl.store(o_rows + 2 * P, acc2 * inv[:, None], mask=rmask[:, None])
        tl.store(o_rows + 3 * P, acc3 * inv[:, None], mask=rmask[:, None])
        tl.store(pl_ptr + b * stride_lb + qpos * stride_lt + head * stride_lh + split, lse, mask=rmask)

    @triton.jit(do_not_specialize=["NPARTS"])
    def _merge_kernel(po_ptr, pl_ptr, o_ptr, NPARTS, SP: tl.constexpr, D: tl.constexpr, DC: tl.constexpr,
                      CH: tl.constexpr):
        # grid: (B · QL · Hq, D / DC): DC dims of one output row from its NPARTS partial rows, weights
        # exp2(lse_i - max). Many small programs and CH parts per load: with few rows (B = 1, 12 heads)
        # and a hundred splits, one program per row looping over the parts was a fixed ~20 µs.
        row = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * DC + tl.arange(0, DC)
        s = tl.arange(0, SP)
        lse = tl.load(pl_ptr + row * NPARTS + s, mask=s < NPARTS, other=float("-inf"))
        mx = tl.max(lse, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # no part saw a token: output 0, not NaN
        den = tl.sum(tl.exp2(lse - mx), axis=0)
        acc = tl.zeros([DC], tl.float32)
        for c in range(0, NPARTS, CH):
            sc = c + tl.arange(0, CH)
            m = sc < NPARTS
            w = tl.exp2(tl.load(pl_ptr + row * NPARTS + sc, mask=m, other=float("-inf")) - mx)
            po = tl.load(po_ptr + (row * NPARTS + sc[:, None]) * D + d[None, :], mask=m[:, None], other=0.0)
            acc += tl.sum(po * w[:, None], axis=0)
        tl.store(o_ptr + row * D + d, acc / tl.where(den > 0, den, 1.0))


@dataclass(frozen=True)
class DecodeConfig:
    """Launch knobs of `_decode_kernel`. The defaults are what the served path runs: the H200 sweep's best
    (bench_kv run 2: BLOCK_N 128, 4 warps, 2 stages)."""

    block_n: int | None = None  # page tokens per step; must divide the page size. None: the largest of
    # 128 / 64 / 32 / 16 that does
    block_w: int = 32  # bf16-window tokens per step
    warps: int = 4  # num_warps
    stages: int | None = 2  # num_stages (the page loop's pipelining); None: Triton's default

    def tile(self, block_size: int) -> int:
        """BLOCK_N for pages of block_size tokens."""
        if self.block_n is None:  # the largest tile that divides the page (128 was fastest on the H200)
            return next(n for n in (128, 64, 32, 16) if block_size % n == 0 or n == 16)
        return self.block_n


def auto_splits(max_tokens: int, batch: int, programs_per_split: int, block_n: int = 128,
                target_programs: int = 264, min_chunk: int = 256, max_splits: int = 512) -> int:
    """Splits S of the quantized part so that batch · programs_per_split · (S + 1) programs (the + 1 is
    the bf16 part's program) come to about target_programs, without chunks under min_chunk tokens.

    264 = 2 programs per SM on the H200's 132 SMs (the register count allows 2): one full wave. Run 2 of
    bench_kv counted only S and launched 268 programs, 1.02 waves, and Nsight Compute put the tail of
    that partial wave at up to half the kernel's time (docs/kv-cache.md)."""
    by_len = max(1, max_tokens // max(min_chunk, block_n))
    by_grid = max(1, target_programs // max(1, batch * programs_per_split) - 1)
    return int(max(1, min(by_len, by_grid, max_splits)))


def decode(q_rot: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, n_quant: torch.Tensor,
           win_k: torch.Tensor, win_v: torch.Tensor, n_win: torch.Tensor, fmt: KVFormat, block_size: int,
           sm_scale: float, *, config: DecodeConfig | None = None, num_splits: int | None = None,
           out: torch.Tensor | None = None, heads_per_program: int | None = None, q_start: int = 0,
           _unsafe: bool = False) -> torch.Tensor:
    """Rotated queries q_rot [B, QL, Hq, D] -> rotated attention output [B, QL, Hq, D] float32.

    cache uint8 [num_blocks, Hkv, block_size · slot_bytes]; block_table int32 [B, max_blocks];
    n_quant int32 [B] tokens in pages; win_k/win_v bf16 [B, Hkv, Wcap, D] (rotated, contiguous last dim)
    with n_win int32 [B] tokens (newest last, the QL query tokens among them). config: the launch knobs
    (default DecodeConfig(), what the served path runs). heads_per_program sets the head tile (default: the
    whole GQA group; 1 is the one-program-per-query-head baseline); it must divide the group (`_unsafe=True`
    skips that check, for the test that shows the comparison catches it).
    q_start: page tokens [0, q_start) are skipped (a serving engine's pages hold every token, the sinks'
    too, while their bf16 copies are in the window), as in reference.decode_ref.
    num_splits None picks auto_splits from n_quant (a host sync).
    """
    require()
    bsz, ql, hq, d = q_rot.shape
    hkv = cache.shape[1]
    if hq % hkv or d != fmt.head_dim or cache.shape[2] != fmt.page_bytes(block_size):
        raise ValueError(f"decode: q {tuple(q_rot.shape)}, cache {tuple(cache.shape)} do not match {fmt} / "
                         f"block_size {block_size}")
    group = hq // hkv
    ht = heads_per_program or group
    if group % ht and not _unsafe:
        raise ValueError(f"decode: a head tile of {ht} does not divide the GQA group of {group}: its rows "
                         "would read the wrong KV head")
    if hq % ht:
        raise ValueError(f"decode: {hq} query heads do not split into tiles of {ht}")
    c = config or DecodeConfig()
    block_n = c.tile(block_size)
    if block_size % block_n:
        raise ValueError(f"decode: BLOCK_N {block_n} must divide the page size {block_size}")
    if q_rot.stride(-1) != 1 or win_k.stride(-1) != 1 or win_k.stride() != win_v.stride():
        raise ValueError("decode: q and window tensors need contiguous last dims (and equal window strides)")
    if num_splits is None:
        num_splits = auto_splits(int(n_quant.max().item()) if n_quant.numel() else 0, bsz, hq // ht, block_n)
    rows = max(16, triton.next_power_of_2(ql * ht))
    nparts = num_splits + 1
    dev = q_rot.device
    po = torch.empty(bsz, ql, hq, nparts, d, dtype=torch.float32, device=dev)
    pl = torch.empty(bsz, ql, hq, nparts, dtype=torch.float32, device=dev)
    kw = {} if c.stages is None else {"num_stages": c.stages}
    _decode_kernel[(bsz, hq // ht, nparts)](
        q_rot, cache, block_table, n_quant, win_k, win_v, n_win, po, pl, sm_scale * LOG2E, num_splits, q_start,
        q_rot.stride(0), q_rot.stride(1), q_rot.stride(2), cache.stride(0), cache.stride(1), block_table.stride(0),
        win_k.stride(0), win_k.stride(1), win_k.stride(2), po.stride(0), po.stride(1), po.stride(2), po.stride(3),
        pl.stride(0), pl.stride(1), pl.stride(2), BS=block_size, D=d, QL=ql, HT=ht, GROUP=group, ROWS=rows, K_BITS=fmt.k_bits,
        **fmt.kernel_offsets(block_size),
        BLOCK_N=block_n, BLOCK_W=c.block_w, num_warps=c.warps, **kw)
    if out is None:
        out = torch.empty(bsz, ql, hq, d, dtype=torch.float32, device=dev)
    _merge_kernel[(bsz * ql * hq, d // 64)](po, pl, out, nparts, SP=max(16, triton.next_power_of_2(nparts)), D=d,
                                            DC=64, CH=64, num_warps=4)
    return out
