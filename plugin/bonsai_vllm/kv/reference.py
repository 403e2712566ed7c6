"""PyTorch reference of the quantized KV cache: quantize, pack into pages, dequantize, attend (the judge).

Every Triton kernel in this package (store.py, decode.py) is checked against the functions here. Shapes:
B sequences, QL query positions per sequence (1 for plain decode, 1 + k for speculative verify rows),
Hq query heads, Hkv KV heads (group = Hq / Hkv query heads share a KV head; 6 for the 27B), D head_dim.

The quantizer (per vector of D rotated values, float32):
    t      = sorted(|x|)[ceil(clip·D) - 1]            (clip < 1; else no clipping)
    xc     = clamp(x, -t, t)
    scale  = fp16((max(xc) - min(xc)) / (2^bits - 1)), mn = fp16(min(xc))      stored
    q      = clamp(floor((xc - mn) / scale + 0.5), 0, 2^bits - 1)             against the stored fp16 values
    x̂      = q · scale + mn
"""

from __future__ import annotations

import math

import torch

from bonsai_vllm.kv.format import KVFormat

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------- quantizer

def quantize(x: torch.Tensor, bits: int, clip: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes uint8 [..., D], scale fp16 [...], mn fp16 [...])."""
    x = x.float()
    d = x.shape[-1]
    levels = (1 << bits) - 1
    if clip < 1.0:
        kidx = max(0, math.ceil(clip * d) - 1)
        t = x.abs().sort(dim=-1).values[..., kidx:kidx + 1]
        x = torch.minimum(torch.maximum(x, -t), t)
    mn = x.amin(-1)
    mx = x.amax(-1)
    scale = ((mx - mn) / levels).half()
    mn16 = mn.half()
    s = scale.float()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.floor((x - mn16.float()[..., None]) * inv[..., None] + 0.5).clamp(0, levels)
    return q.to(torch.uint8), scale, mn16


def dequantize(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float()[..., None] + mn.float()[..., None]


def quantize_dequantize(x: torch.Tensor, bits: int, clip: float) -> torch.Tensor:
    return dequantize(*quantize(x, bits, clip))


# ------------------------------------------------------------------------------------------- packing

def pack_2bit(q: torch.Tensor) -> torch.Tensor:
    """codes [..., D] (< 4) -> uint8 [..., D/4]: byte j = Σ_i q[P·i + j] << 2i, P = D/4."""
    p = q.shape[-1] // 4
    qi = q.to(torch.int32).reshape(*q.shape[:-1], 4, p) & 3
    sh = (2 * torch.arange(4, device=q.device, dtype=torch.int32))[:, None]
    return (qi << sh).sum(-2).to(torch.uint8)


def unpack_2bit(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., P] -> codes uint8 [..., 4P]."""
    sh = (2 * torch.arange(4, device=b.device, dtype=torch.int32))[:, None]
    return ((b.to(torch.int32)[..., None, :] >> sh) & 3).reshape(*b.shape[:-1], 4 * b.shape[-1]).to(torch.uint8)


def pack_hi(q: torch.Tensor) -> torch.Tensor:
    """Third bits of codes [..., D] -> uint8 [..., D/8]: byte j = Σ_p bit2(q[(D/8)·p + j]) << p."""
    w = q.shape[-1] // 8
    qi = (q.to(torch.int32).reshape(*q.shape[:-1], 8, w) >> 2) & 1
    sh = torch.arange(8, device=q.device, dtype=torch.int32)[:, None]
    return (qi << sh).sum(-2).to(torch.uint8)


def unpack_hi(b: torch.Tensor) -> torch.Tensor:
    sh = torch.arange(8, device=b.device, dtype=torch.int32)[:, None]
    return (((b.to(torch.int32)[..., None, :] >> sh) & 1) << 2).reshape(*b.shape[:-1], 8 * b.shape[-1]).to(torch.uint8)


def encode(k_rot: torch.Tensor, v_rot: torch.Tensor, fmt: KVFormat) -> dict[str, torch.Tensor]:
    """Rotated k, v [..., D] -> the sections of their slots: k_lo, k_hi, v (uint8), meta fp16 [..., 4]."""
    kq, ks, km = quantize(k_rot, fmt.k_bits, fmt.k_clip)
    vq, vs, vm = quantize(v_rot, fmt.v_bits, fmt.v_clip)
    out = {"k_lo": pack_2bit(kq), "v": pack_2bit(vq), "meta": torch.stack([ks, km, vs, vm], -1)}
    if fmt.k_bits == 3:
        out["k_hi"] = pack_hi(kq)
    return out


def decode_slots(sec: dict[str, torch.Tensor], fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Sections -> dequantized (k̂, v̂) float32 [..., D] (still rotated)."""
    kq = unpack_2bit(sec["k_lo"])
    if fmt.k_bits == 3:
        kq = kq | unpack_hi(sec["k_hi"])
    m = sec["meta"].float()
    k = kq.float() * m[..., 0:1] + m[..., 1:2]
    v = unpack_2bit(sec["v"]).float() * m[..., 2:3] + m[..., 3:4]
    return k, v


# ------------------------------------------------------------------------------------------- pages

def new_cache(fmt: KVFormat, num_blocks: int, block_size: int, num_kv_heads: int, device="cpu") -> torch.Tensor:
    """uint8 [num_blocks, Hkv, block_size · slot_bytes], filled with 0xFF so unwritten slots stand out."""
    return torch.full((num_blocks, num_kv_heads, fmt.page_bytes(block_size)), 255, dtype=torch.uint8, device=device)


def _section_views(cache: torch.Tensor, fmt: KVFormat, block_size: int) -> dict[str, torch.Tensor]:
    """Views [num_blocks, Hkv, block_size, bytes] of each section of the pages (meta as fp16 [..., 4])."""
    nb, hkv, _ = cache.shape
    o = fmt.offsets(block_size)

    def sec(name, width):
        return cache[:, :, o[name]:o[name] + block_size * width].view(nb, hkv, block_size, width)

    out = {"k_lo": sec("k_lo", fmt.k_lo_bytes), "v": sec("v", fmt.v_bytes),
           "meta": sec("meta", 8).contiguous().view(torch.float16)}
    if fmt.k_bits == 3:
        out["k_hi"] = sec("k_hi", fmt.k_hi_bytes)
    return out


def store_ref(cache: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor, slots: torch.Tensor,
              fmt: KVFormat, block_size: int) -> None:
    """Quantize rotated k, v [T, Hkv, D] into the pages at slots [T] (block·block_size + offset; < 0 skips)."""
    keep = slots >= 0
    k_rot, v_rot, slots = k_rot[keep], v_rot[keep], slots[keep].long()
    sec = encode(k_rot, v_rot, fmt)
    blk, off = slots // block_size, slots % block_size
    o = fmt.offsets(block_size)
    for name, data in sec.items():
        width = data.shape[-1] * data.element_size()
        raw = data.contiguous().view(torch.uint8).reshape(data.shape[0], data.shape[1], width)  # [T, Hkv, width]
        base = o[name]
        idx = base + off[:, None] * width + torch.arange(width, device=cache.device)  # [T, width]
        for h in range(cache.shape[1]):
            cache[blk[:, None], h, idx] = raw[:, h]


def gather_ref(cache: torch.Tensor, block_table: torch.Tensor, n: int, fmt: KVFormat,
               block_size: int, start: int = 0) -> dict[str, torch.Tensor]:
    """Slots [start, n) of one sequence (block_table [max_blocks]) as sections [n - start, Hkv, bytes]."""
    views = _section_views(cache, fmt, block_size)
    t = torch.arange(start, n, device=cache.device)
    blk = block_table.long()[t // block_size]
    off = t % block_size
    return {name: v[blk, :, off] for name, v in views.items()}


# ---------------------------------------------------------------------------------------- attention

def decode_ref(q_rot: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, n_quant: torch.Tensor,
               win_k: torch.Tensor, win_v: torch.Tensor, n_win: torch.Tensor, fmt: KVFormat, block_size: int,
               sm_scale: float, return_parts: bool = False, q_start: int = 0):
    """Attention of rotated queries over (dequantized pages ++ bf16 window), merged by log-sum-exp.

    q_rot [B, QL, Hq, D]; pages hold n_quant[b] tokens; win_k/win_v [B, Hkv, Wcap, D] (rotated, bf16) hold
    n_win[b] tokens, the newest last. Query position j of QL sees the quantized part and the window up to
    n_win - (QL - 1 - j) (the verify rows of speculative decoding are the newest tokens, in the window).
    Page tokens [0, q_start) are left out (a serving engine keeps every token in the pages, the sinks
    too, whose bf16 copies are in the window). Returns the rotated output [B, QL, Hq, D] float32
    (computed in float64).
    """
    bsz, ql, hq, d = q_rot.shape
    hkv = cache.shape[1]
    g = hq // hkv
    out = torch.zeros(bsz, ql, hq, d, dtype=torch.float64, device=q_rot.device)
    parts = []
    for b in range(bsz):
        nq, nw = int(n_quant[b]), int(n_win[b])
        # query heads grouped by their KV head: [QL, Hkv, G, D] (no copies of K/V per query head)
        q = (q_rot[b].double() * sm_scale).reshape(ql, hkv, g, d)
        if nq > q_start:
            kd, vd = decode_slots(gather_ref(cache, block_table[b], nq, fmt, block_size), fmt)  # [nq, Hkv, D]
            kd, vd = kd[q_start:], vd[q_start:]
            s1 = torch.einsum("qhgd,nhd->qhgn", q, kd.double())
            lse1 = torch.logsumexp(s1, -1)
            o1 = torch.einsum("qhgn,nhd->qhgd", torch.softmax(s1, -1), vd.double())
        else:
            lse1 = torch.full((ql, hkv, g), -math.inf, dtype=torch.float64, device=q.device)
            o1 = torch.zeros(ql, hkv, g, d, dtype=torch.float64, device=q.device)
        wk = win_k[b, :, :nw].double()  # [Hkv, nw, D]
        wv = win_v[b, :, :nw].double()
        s2 = torch.einsum("qhgd,hnd->qhgn", q, wk)
        vis = torch.arange(nw, device=q.device)[None, :] < (nw - (ql - 1 - torch.arange(ql, device=q.device)))[:, None]
        s2 = s2.masked_fill(~vis[:, None, None, :], -math.inf)
        lse2 = torch.logsumexp(s2, -1) if nw else torch.full_like(lse1, -math.inf)
        o2 = torch.einsum("qhgn,hnd->qhgd", torch.softmax(s2, -1).nan_to_num(0.0), wv) if nw else torch.zeros_like(o1)
        # log-sum-exp merge: weights exp(lse_i - lse) of the two normalized parts
        lse = torch.logaddexp(lse1, lse2)
        w1 = torch.exp(lse1 - lse).nan_to_num(0.0)[..., None]
        w2 = torch.exp(lse2 - lse).nan_to_num(0.0)[..., None]
        out[b] = (w1 * o1 + w2 * o2).reshape(ql, hq, d)
        parts.append((o1.reshape(ql, hq, d), lse1.reshape(ql, hq), o2.reshape(ql, hq, d), lse2.reshape(ql, hq)))
    return (out.float(), parts) if return_parts else out.float()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Exact causal-last attention in float64: q [B, QL, Hq, D], k/v [B, N, Hkv, D] (query j of QL is at
    position N - QL + j). The ground truth the quantized path is judged against."""
    bsz, ql, hq, d = q.shape
    n, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = (q.double() * sm_scale).reshape(bsz, ql, hkv, g, d)
    s = torch.einsum("bqhgd,bnhd->bqhgn", qg, k.double())
    vis = torch.arange(n, device=q.device)[None, :] <= (n - ql + torch.arange(ql, device=q.device))[:, None]
    s = s.masked_fill(~vis[None, :, None, None, :], -math.inf)
    o = torch.einsum("bqhgn,bnhd->bqhgd", torch.softmax(s, -1), v.double())
    return o.reshape(bsz, ql, hq, d).float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a - b‖ / ‖b‖ (Frobenius, float64); inf if a holds a NaN/inf (e.g. an unwritten poisoned output)."""
    if not torch.isfinite(a).all():
        return math.inf
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# ----------------------------------------------------------------- TurboQuant k3v4 (comparison only)

_LLOYD_CACHE: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def lloyd_max_gaussian(bits: int, d: int, iters: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """MSE-optimal (Lloyd-Max) levels and thresholds for N(0, 1/d): centroids [2^bits], boundaries [2^bits - 1].

    Closed forms for a Gaussian: mass Φ(b) - Φ(a), first moment σ(φ(a) - φ(b)) on each cell.
    """
    key = (bits, d)
    if key in _LLOYD_CACHE:
        return _LLOYD_CACHE[key]
    n = 1 << bits
    sigma = d ** -0.5
    pdf = lambda z: math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731
    c = [-2.5 + 5.0 * (i + 0.5) / n for i in range(n)]  # in units of sigma
    for _ in range(iters):
        edges = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(n - 1)] + [math.inf]
        c = [((pdf(a) if a > -math.inf else 0.0) - (pdf(b) if b < math.inf else 0.0)) / max(cdf(b) - cdf(a), 1e-300)
             for a, b in zip(edges[:-1], edges[1:])]
    cent = torch.tensor(c, dtype=torch.float64) * sigma
    bnd = (cent[1:] + cent[:-1]) / 2
    _LLOYD_CACHE[key] = (cent.float(), bnd.float())
    return _LLOYD_CACHE[key]


def turboquant_k3v4(k_rot: torch.Tensor, v_rot: torch.Tensor, k_bits: int = 3, v_bits: int = 4,
                    norm_correction: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize-dequantize in the style of vLLM's `turboquant_k3v4_nc` (our reading of its store/decode):

    - K: unit-normalize the rotated key, bucketize each coordinate by the Lloyd-Max thresholds for
      N(0, 1/D), keep an fp16 norm; dequant = norm · c (c re-normalized to unit length: "nc").
    - V: per-vector min/max uniform 4-bit, no clipping, codes computed against the float32 scale/min,
      stored (and dequantized) in fp16; floor(x/scale + 0.5) rounding, scale floored at 1e-8.
    Assumptions (vLLM rotates keys only, with one Hadamard for all layers): here both K and V get the same
    rotation as K3V2, which can only help its 4-bit values; no bf16 recent window (vLLM has none).
    """
    d = k_rot.shape[-1]
    cent, bnd = lloyd_max_gaussian(k_bits, d)
    cent, bnd = cent.to(k_rot.device), bnd.to(k_rot.device)
    k = k_rot.float()
    norm = k.norm(dim=-1, keepdim=True)
    unit = k / norm.clamp_min(1e-30)
    idx = torch.bucketize(unit, bnd, right=True)
    c = cent[idx]
    if norm_correction:
        c = c / c.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    k_hat = norm.half().float() * c
    v = v_rot.float()
    mn = v.amin(-1, keepdim=True)
    mx = v.amax(-1, keepdim=True)
    levels = (1 << v_bits) - 1
    scale = ((mx - mn) / levels).clamp_min(1e-8)
    q = ((v - mn) / scale + 0.5).floor().clamp(0, levels)
    v_hat = q * scale.half().float() + mn.half().float()
    return k_hat, v_hat
