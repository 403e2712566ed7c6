"""K3V2 decode variants that were measured and are not dispatched: bench_kv checks and times them beside the
served kernel (`bonsai_vllm.kv.kernels.decode`), which holds only what the served path launches.

`_decode_variants_kernel` is the decode kernel as it was before the served one kept only its winner, with
two constexpr switches (decode.py's docstring has the measurements):
- UNPACK: 0 "cvt", ((byte >> 2i) & 3) → integer-to-fp16 conversion (2·D conversions per token, at a quarter
  of the integer rate on Hopper); 1 "bits", the codes as subnormal fp16 with the third key bit moved beside
  the low two by a per-column shift; 2 the served unpacking (the third key bit in its own products).
- ILP: one product chain per piece, summed at the end, so the tensor cores do not wait on one 12-deep
  accumulation chain (it spilled at BLOCK_N 128 and was slower).
With UNPACK = 2 and no ILP it computes what the served kernel does. `decode_variant` runs a `DecodeVariant`:
through the served `decode` when it is the served unpacking without ILP, else through this kernel (then the
served `_merge_kernel`). Same arguments and output as `decode`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from bonsai_vllm.kv.format import KVFormat
from bonsai_vllm.kv.kernels import decode as served
from bonsai_vllm.kv.kernels.decode import DecodeConfig
from bonsai_vllm.kv.reference import LOG2E
from bonsai_vllm.triton_runtime import require, tl, triton


@dataclass(frozen=True)
class DecodeVariant:
    """One decode candidate of bench_kv: the served kernel's launch knobs and what only this module varies."""

    config: DecodeConfig = field(default_factory=DecodeConfig)  # block_n, block_w, warps, stages
    unpack: int = 2  # 0 "cvt", 1 "bits", 2 the served unpacking (see the module docstring)
    ilp: bool = False  # independent per-piece product chains
    target: int = 528  # programs auto_splits aims the split count at (264: one wave of 2 per SM on the H200)

    @property
    def served(self) -> bool:
        """Whether the served kernel computes this variant (then `decode_variant` runs that one)."""
        return self.unpack == 2 and not self.ilp

    def to_dict(self) -> dict:
        """Flat, as bench-kv.json records it (and `from_dict` reads it back; also the older files)."""
        return dict(asdict(self.config), unpack=self.unpack, ilp=int(self.ilp), target=self.target)

    @classmethod
    def from_dict(cls, d: dict) -> DecodeVariant:
        cfg = DecodeConfig(block_n=d.get("block_n"), block_w=d.get("block_w", 32), warps=d.get("warps", 4),
                           stages=d.get("stages"))
        return cls(cfg, unpack=d.get("unpack", 2), ilp=bool(d.get("ilp", 1)), target=d.get("target", 528))

    def __str__(self) -> str:
        c = self.config
        return (f"unpack={self.unpack} block_n={c.block_n} block_w={c.block_w} warps={c.warps} stages={c.stages} "
                f"ilp={int(self.ilp)} target={self.target}")


if triton is not None:
    from bonsai_vllm.kv.kernels.decode import _hbits, _merge_kernel, _online

    @triton.jit
    def _kcodes(lo, hi, i: tl.constexpr, jh, K_BITS: tl.constexpr, UNPACK: tl.constexpr):
        """Key codes of piece i as fp16 [P, N] from bytes lo, hi [P, N] (jh [P, 1]: column in upper half).

        The tiles are loaded transposed ([dims, tokens], the B operand of q · kᵀ as it is consumed), so
        the compiler can keep the raw bytes in the operand layout and unpack them there instead of
        round-tripping the unpacked fp16 tile through shared memory."""
        if UNPACK == 0:
            c = (lo >> (2 * i)) & 3
            if K_BITS == 3:
                c = c | (((hi >> (2 * i + jh)) & 1) << 2)
            return c.to(tl.float16)
        elif UNPACK == 2:  # low two bits only; the third goes through its own products (_hbits)
            return (lo & (3 << (2 * i))).to(tl.int16).to(tl.float16, bitcast=True)
        else:
            c = lo & (3 << (2 * i))  # c_lo · 4^i
            if K_BITS == 3:
                c = c | ((hi & (1 << (2 * i + jh))) << (2 - jh))  # + 4·c_hi · 4^i
            return c.to(tl.int16).to(tl.float16, bitcast=True)  # subnormal: c · 4^i · 2^-24

    @triton.jit
    def _vcodes(v, i: tl.constexpr, UNPACK: tl.constexpr):
        if UNPACK == 0:
            return ((v >> (2 * i)) & 3).to(tl.float16)
        else:
            return (v & (3 << (2 * i))).to(tl.int16).to(tl.float16, bitcast=True)

    @triton.jit(do_not_specialize=["NUM_SPLITS", "Q_START"])
    def _decode_variants_kernel(q_ptr, cache_ptr, bt_ptr, nq_ptr, wk_ptr, wv_ptr, nw_ptr, po_ptr, pl_ptr, qk_scale, NUM_SPLITS, Q_START,
                       stride_qb, stride_qt, stride_qh, stride_cb, stride_ch, stride_btb,
                       stride_wb, stride_wh, stride_wt, stride_pb, stride_pt, stride_ph, stride_ps,
                       stride_lb, stride_lt, stride_lh, BS: tl.constexpr, D: tl.constexpr, QL: tl.constexpr,
                       HT: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, K_BITS: tl.constexpr,
                       OFF_HI: tl.constexpr, OFF_V: tl.constexpr, OFF_META: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, UNPACK: tl.constexpr, ILP: tl.constexpr):
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
        jh = (j >= W).to(tl.int32)[:, None]  # [P, 1] dim in the upper half of a piece: third bit at 2i + 1
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
            # q pieces, scaled to log2 units; "bits" also folds the 4^-i of the unshifted codes in.
            q0 = tl.load(q_rows, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
            q1 = tl.load(q_rows + P, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
            q2 = tl.load(q_rows + 2 * P, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
            q3 = tl.load(q_rows + 3 * P, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
            if UNPACK >= 1:
                q1 = q1 * 0.25
                q2 = q2 * 0.0625
                q3 = q3 * 0.015625
            if UNPACK == 2 and K_BITS == 3:
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
            qsum = tl.sum(q0.to(tl.float32), axis=1) + tl.sum(q1.to(tl.float32), axis=1) * (4.0 if UNPACK >= 1 else 1.0) \
                + tl.sum(q2.to(tl.float32), axis=1) * (16.0 if UNPACK >= 1 else 1.0) \
                + tl.sum(q3.to(tl.float32), axis=1) * (64.0 if UNPACK >= 1 else 1.0)
            CF: tl.constexpr = 16777216.0 if UNPACK >= 1 else 1.0  # 2^24 for subnormal codes
            # value pieces i: the subnormal codes are c · 4^i · 2^-24 (plain c with UNPACK 0)
            VF0: tl.constexpr = CF
            VF1: tl.constexpr = 4194304.0 if UNPACK >= 1 else 1.0
            VF2: tl.constexpr = 1048576.0 if UNPACK >= 1 else 1.0
            VF3: tl.constexpr = 262144.0 if UNPACK >= 1 else 1.0
            for t0 in range(start, end, BLOCK_N):
                pg = tl.load(bt_ptr + b * stride_btb + t0 // BS).to(tl.int64)
                base = cache_ptr + pg * stride_cb + kvh * stride_ch
                off = t0 % BS + tl.arange(0, BLOCK_N)
                tok = t0 + tl.arange(0, BLOCK_N)
                tm = (tok < end) & (tok >= Q_START)  # pages before Q_START hold the bf16 sinks' tokens
                # K bytes as [P, BLOCK_N] (dims × tokens): see _kcodes
                lo = tl.load(base + off[None, :] * P + j[:, None], mask=tm[None, :], other=0).to(tl.int32)
                if K_BITS == 3 and UNPACK == 2:
                    jw2 = tl.arange(0, W)
                    hi = tl.load(base + OFF_HI + off[None, :] * W + jw2[:, None], mask=tm[None, :], other=0).to(tl.int32)
                elif K_BITS == 3:
                    hi = tl.load(base + OFF_HI + off[None, :] * W + (j % W)[:, None], mask=tm[None, :],
                                 other=0).to(tl.int32)
                else:
                    hi = lo
                mp = (base + OFF_META + off * 8).to(tl.pointer_type(tl.float16))
                ks = tl.load(mp, mask=tm, other=0.0).to(tl.float32) * CF
                km = tl.load(mp + 1, mask=tm, other=0.0).to(tl.float32)
                vs = tl.load(mp + 2, mask=tm, other=0.0).to(tl.float32)
                vm = tl.load(mp + 3, mask=tm, other=0.0).to(tl.float32)

                if ILP:
                    # one product chain per piece, summed at the end: the four chains are independent,
                    # so the tensor cores are not waiting on one 12-deep accumulation chain (decode is
                    # latency-bound at 2 programs per SM)
                    c0 = tl.dot(q0, _kcodes(lo, hi, 0, jh, K_BITS, UNPACK))
                    c1 = tl.dot(q1, _kcodes(lo, hi, 1, jh, K_BITS, UNPACK))
                    c2 = tl.dot(q2, _kcodes(lo, hi, 2, jh, K_BITS, UNPACK))
                    c3 = tl.dot(q3, _kcodes(lo, hi, 3, jh, K_BITS, UNPACK))
                    if UNPACK == 2 and K_BITS == 3:
                        c0 = tl.dot(hb0, _hbits(hi, 1), tl.dot(ha0, _hbits(hi, 0), c0))
                        c1 = tl.dot(hb1, _hbits(hi, 3), tl.dot(ha1, _hbits(hi, 2), c1))
                        c2 = tl.dot(hb2, _hbits(hi, 5), tl.dot(ha2, _hbits(hi, 4), c2))
                        c3 = tl.dot(hb3, _hbits(hi, 7), tl.dot(ha3, _hbits(hi, 6), c3))
                    s = (c0 + c1) + (c2 + c3)
                else:
                    s = tl.dot(q0, _kcodes(lo, hi, 0, jh, K_BITS, UNPACK))
                    s = tl.dot(q1, _kcodes(lo, hi, 1, jh, K_BITS, UNPACK), s)
                    s = tl.dot(q2, _kcodes(lo, hi, 2, jh, K_BITS, UNPACK), s)
                    s = tl.dot(q3, _kcodes(lo, hi, 3, jh, K_BITS, UNPACK), s)
                    if UNPACK == 2 and K_BITS == 3:
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
                acc0 = acc0 * alpha[:, None] + (tl.dot(pv, _vcodes(vv, 0, UNPACK)) * VF0 - c15)
                acc1 = acc1 * alpha[:, None] + (tl.dot(pv, _vcodes(vv, 1, UNPACK)) * VF1 - c15)
                acc2 = acc2 * alpha[:, None] + (tl.dot(pv, _vcodes(vv, 2, UNPACK)) * VF2 - c15)
                acc3 = acc3 * alpha[:, None] + (tl.dot(pv, _vcodes(vv, 3, UNPACK)) * VF3 - c15)
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


def decode_variant(q_rot: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, n_quant: torch.Tensor,
                   win_k: torch.Tensor, win_v: torch.Tensor, n_win: torch.Tensor, fmt: KVFormat, block_size: int,
                   sm_scale: float, *, variant: DecodeVariant | None = None, num_splits: int | None = None,
                   out: torch.Tensor | None = None, heads_per_program: int | None = None, q_start: int = 0,
                   _unsafe: bool = False) -> torch.Tensor:
    """`decode` (same arguments and output) with `variant`: the served kernel where it computes the variant,
    else `_decode_variants_kernel`."""
    v = variant or DecodeVariant()
    kw = dict(num_splits=num_splits, out=out, heads_per_program=heads_per_program, q_start=q_start,
              _unsafe=_unsafe)
    if v.served:
        return served.decode(q_rot, cache, block_table, n_quant, win_k, win_v, n_win, fmt, block_size, sm_scale,
                             config=v.config, **kw)
    require()
    bsz, ql, hq, d = q_rot.shape
    hkv = cache.shape[1]
    if hq % hkv or d != fmt.head_dim or cache.shape[2] != fmt.page_bytes(block_size):
        raise ValueError(f"decode_variant: q {tuple(q_rot.shape)}, cache {tuple(cache.shape)} do not match "
                         f"{fmt} / block_size {block_size}")
    group = hq // hkv
    ht = heads_per_program or group
    if (group % ht and not _unsafe) or hq % ht:
        raise ValueError(f"decode_variant: a head tile of {ht} does not divide the GQA group of {group}")
    block_n = v.config.tile(block_size)
    if block_size % block_n:
        raise ValueError(f"decode_variant: BLOCK_N {block_n} must divide the page size {block_size}")
    if q_rot.stride(-1) != 1 or win_k.stride(-1) != 1 or win_k.stride() != win_v.stride():
        raise ValueError("decode_variant: q and window tensors need contiguous last dims (and equal window strides)")
    if num_splits is None:
        num_splits = served.auto_splits(int(n_quant.max().item()) if n_quant.numel() else 0, bsz, hq // ht,
                                        block_n)
    rows = max(16, triton.next_power_of_2(ql * ht))
    nparts = num_splits + 1
    dev = q_rot.device
    po = torch.empty(bsz, ql, hq, nparts, d, dtype=torch.float32, device=dev)
    pl = torch.empty(bsz, ql, hq, nparts, dtype=torch.float32, device=dev)
    stages = {} if v.config.stages is None else {"num_stages": v.config.stages}
    _decode_variants_kernel[(bsz, hq // ht, nparts)](
        q_rot, cache, block_table, n_quant, win_k, win_v, n_win, po, pl, sm_scale * LOG2E, num_splits, q_start,
        q_rot.stride(0), q_rot.stride(1), q_rot.stride(2), cache.stride(0), cache.stride(1), block_table.stride(0),
        win_k.stride(0), win_k.stride(1), win_k.stride(2), po.stride(0), po.stride(1), po.stride(2), po.stride(3),
        pl.stride(0), pl.stride(1), pl.stride(2), BS=block_size, D=d, QL=ql, HT=ht, GROUP=group, ROWS=rows,
        K_BITS=fmt.k_bits, **fmt.kernel_offsets(block_size), BLOCK_N=block_n, BLOCK_W=v.config.block_w,
        UNPACK=v.unpack, ILP=int(v.ilp), num_warps=v.config.warps, **stages)
    if out is None:
        out = torch.empty(bsz, ql, hq, d, dtype=torch.float32, device=dev)
    _merge_kernel[(bsz * ql * hq, d // 64)](po, pl, out, nparts, SP=max(16, triton.next_power_of_2(nparts)), D=d,
                                            DC=64, CH=64, num_warps=4)
    return out
