"""core/kv: the format's bytes, the quantizer and packing, the rotations, and the capacity arithmetic.

No kernels here (test_kv_kernels.py) and no attention (test_kv_attention.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from bonsai_vllm.ternary.reference import hadamard_matrix
from bonsai_vllm.kv import capacity
from bonsai_vllm.kv import reference as ref
from bonsai_vllm.kv.format import K2V2, K3V2, KVFormat
from bonsai_vllm.kv.rotation import KVRotation, calibrate, fwht_rotate, save_rotations


# ------------------------------------------------------------------------------------------- format

def test_bytes_per_token_per_kv_head():
    """Report 002 §4.2's figure (docs/field-reports.md): 168 B for K3V2 at head_dim 256
    (96 + 64 + 2·(fp16 scale + min)); K2V2 136."""
    assert K3V2.slot_bytes == 168 and (K3V2.k_lo_bytes, K3V2.k_hi_bytes, K3V2.v_bytes) == (64, 32, 64)
    assert K2V2.slot_bytes == 136
    assert K3V2.page_bytes(2464) == 2464 * 168
    o = K3V2.offsets(16)
    assert (o["k_lo"], o["k_hi"], o["v"], o["meta"], o["page"]) == (0, 1024, 1536, 2560, 2688)
    # per GPU at TP=2: 16 layers × 2 KV heads × 168 B (docs/design.md §1)
    assert 16 * 2 * K3V2.slot_bytes == 5376


def test_format_validation():
    with pytest.raises(ValueError):
        KVFormat(head_dim=96)
    with pytest.raises(ValueError):
        KVFormat(k_bits=4)
    with pytest.raises(ValueError):
        KVFormat(v_clip=0.0)
    assert K3V2.clip_index(0.96) == 245  # ceil(0.96 · 256) - 1
    assert K3V2.clip_index(1.0) == -1


# ---------------------------------------------------------------------------------------- quantizer

def test_pack_unpack_roundtrip():
    g = torch.Generator().manual_seed(0)
    q3 = torch.randint(0, 8, (5, 3, 256), generator=g).to(torch.uint8)
    assert torch.equal(ref.unpack_2bit(ref.pack_2bit(q3)) | ref.unpack_hi(ref.pack_hi(q3)), q3)
    q2 = q3 & 3
    assert torch.equal(ref.unpack_2bit(ref.pack_2bit(q2)), q2)
    # the documented bit positions: dim P·i + j at bits 2i of byte j; third bit of dim W·p + j at bit p
    one = torch.zeros(256, dtype=torch.uint8)
    one[64 * 2 + 5] = 3
    assert ref.pack_2bit(one)[5] == 3 << 4
    one[:] = 0
    one[32 * 6 + 7] = 4
    assert ref.pack_hi(one)[7] == 1 << 6


def test_quantizer_definition():
    """Codes in range, scale and min stored in fp16 and used as stored, clipping at the documented index."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g)
    for bits, clip in ((3, 0.96), (2, 0.92), (3, 1.0)):
        q, s, m = ref.quantize(x, bits, clip)
        assert q.dtype == torch.uint8 and int(q.max()) <= (1 << bits) - 1
        assert s.dtype == torch.float16 and m.dtype == torch.float16
        xh = ref.dequantize(q, s, m)
        if clip < 1:
            t = x.abs().sort(-1).values[:, math.ceil(clip * 256) - 1:][:, :1]
            xc = torch.minimum(torch.maximum(x, -t), t)
        else:
            xc = x
        # every clipped value is within half a step of its reconstruction (+ the fp16 rounding of min/scale)
        step = s.float()[:, None]
        assert ((xh - xc).abs() <= 0.5 * step + 2e-3 * xc.abs().amax(-1, keepdim=True)).all()
    # a constant vector: scale 0, no division by zero, reconstructed exactly (up to fp16)
    q, s, m = ref.quantize(torch.full((2, 256), 0.3), 3, 0.96)
    assert float(s.float().abs().max()) == 0 and torch.allclose(ref.dequantize(q, s, m), torch.full((2, 256), 0.3),
                                                               atol=1e-3)


# Stated bounds for the per-vector relative error ‖x̂ - x‖ / ‖x‖ on N(0, 1) vectors (rotated data looks like
# that), measured 0.193 (K 3-bit, clip 0.96) and 0.359 (V 2-bit, clip 0.92) at 4096 × 256.
K3_BOUND, V2_BOUND = 0.21, 0.38


def test_quantization_error_bounds_random_and_outliers():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2048, 256, generator=g)
    assert ref.rel_err(ref.quantize_dequantize(x, 3, K3V2.k_clip), x) < K3_BOUND
    assert ref.rel_err(ref.quantize_dequantize(x, 2, K3V2.v_clip), x) < V2_BOUND
    # outlier-heavy: Student-t(3) entries and a few channels ×12 — fine once rotated, not before
    torch.manual_seed(2)
    t = torch.distributions.StudentT(3.0).sample((2048, 256))
    t[:, [3, 77, 150, 201]] *= 12
    rot = KVRotation.randomized_hadamard(0, 1, 256)
    tr = rot.rotate_k(t[:, None, :])[:, 0]
    assert ref.rel_err(ref.quantize_dequantize(tr, 3, K3V2.k_clip), tr) < K3_BOUND
    assert ref.rel_err(ref.quantize_dequantize(tr, 2, K3V2.v_clip), tr) < V2_BOUND
    # the broken variant: the same quantizer without the rotation misses both bounds by far
    assert ref.rel_err(ref.quantize_dequantize(t, 3, K3V2.k_clip), t) > 2 * K3_BOUND
    assert ref.rel_err(ref.quantize_dequantize(t, 2, K3V2.v_clip), t) > 1.5 * V2_BOUND


def test_encode_store_gather_roundtrip():
    """store_ref writes each section at the documented offsets; gather_ref + decode_slots read it back."""
    g = torch.Generator().manual_seed(3)
    for fmt in (K3V2, K2V2):
        k = torch.randn(40, 2, 256, generator=g)
        v = torch.randn(40, 2, 256, generator=g)
        cache = ref.new_cache(fmt, 6, 16, 2)
        table = torch.tensor([4, 1, 5], dtype=torch.int32)
        t = torch.arange(40)
        slots = table.long()[t // 16] * 16 + t % 16
        ref.store_ref(cache, k, v, slots, fmt, 16)
        kd, vd = ref.decode_slots(ref.gather_ref(cache, table, 40, fmt, 16), fmt)
        kq = ref.quantize_dequantize(k, fmt.k_bits, fmt.k_clip)
        vq = ref.quantize_dequantize(v, fmt.v_bits, fmt.v_clip)
        assert torch.equal(kd, kq) and torch.equal(vd, vq)
        assert (cache[[0, 2, 3]] == 255).all()  # blocks not in the table untouched
        # the fp16 metadata of token 17 (block 1, offset 1), head 1, at META + 1·8
        o = fmt.offsets(16)
        meta = cache[1, 1, o["meta"] + 8:o["meta"] + 16].view(torch.float16)
        _, s, m = ref.quantize(k[17, 1], fmt.k_bits, fmt.k_clip)
        assert meta[0] == s and meta[1] == m


# ---------------------------------------------------------------------------------------- rotations

def test_randomized_hadamard_is_the_signed_fwht():
    rot = KVRotation.randomized_hadamard(5, 4, 256, seed=1)
    assert rot.rk.shape == (4, 256, 256) and torch.equal(rot.rk[0], rot.rk[3])  # per layer, shared by heads
    assert not torch.equal(rot.rk[0], rot.rv[0])
    eye = torch.eye(256, dtype=torch.float64)
    assert (rot.rk[0].double() @ rot.rk[0].double().T - eye).abs().max() < 1e-5
    signs = (rot.rk[0].double() @ hadamard_matrix(256, torch.float64)).diagonal().sign().float()  # R = diag(s)·H
    x = torch.randn(7, 256)
    assert torch.allclose(x @ rot.rk[0], fwht_rotate(x, signs), atol=1e-5)
    per_head = KVRotation.randomized_hadamard(5, 4, 256, seed=1, per_head=True)
    assert not torch.equal(per_head.rk[0], per_head.rk[1])
    # scores are invariant and the output un-rotation inverts the value rotation
    q, k = torch.randn(2, 24, 256), torch.randn(2, 4, 256)
    s = torch.einsum("bhd,bhd->bh", q, k.repeat_interleave(6, 1))
    sr = torch.einsum("bhd,bhd->bh", rot.rotate_q(q), rot.rotate_k(k).repeat_interleave(6, 1))
    assert torch.allclose(s, sr, atol=1e-3)
    v = torch.randn(2, 24, 256)
    vr = rot.rotate_v(v.reshape(2, 4, 6, 256).transpose(1, 2)).transpose(1, 2).reshape(2, 24, 256)
    assert torch.allclose(rot.unrotate_out(vr), v, atol=1e-4)


def test_calibrated_rotation_file(tmp_path):
    """OSCAR-style calibration: orthogonal, saved and loaded; on strongly anisotropic keys it quantizes
    at least as well as the data-free Hadamard (it makes every coordinate's variance exactly equal)."""
    g = torch.Generator().manual_seed(4)
    scales = torch.logspace(1.5, -1, 256)  # eigen-spectrum over 2.5 decades
    basis = torch.linalg.qr(torch.randn(256, 256, generator=g))[0]
    k = (torch.randn(4096, 2, 256, generator=g) * scales) @ basis.T
    v = torch.randn(4096, 2, 256, generator=g)
    q = torch.randn(4096, 12, 256, generator=g)
    cal = calibrate(k[:2048], v[:2048], q[:2048])
    eye = torch.eye(256, dtype=torch.float64)
    for r in (cal.rk, cal.rv):
        assert (r.double() @ r.double().transpose(1, 2) - eye).abs().max() < 1e-4
    path = tmp_path / "rot.safetensors"
    save_rotations(path, {3: cal})
    back = KVRotation.from_file(path, 3, 2)
    assert torch.equal(back.rk, cal.rk) and torch.equal(back.rv, cal.rv)
    bad = tmp_path / "bad.safetensors"
    save_rotations(bad, {0: KVRotation(cal.rk * 1.1, cal.rv)})
    with pytest.raises(ValueError, match="not orthogonal"):
        KVRotation.from_file(bad, 0, 2)
    test = k[2048:]
    had = KVRotation.randomized_hadamard(0, 2, 256)
    e_cal = ref.rel_err(ref.quantize_dequantize(cal.rotate_k(test), 3, 0.96), cal.rotate_k(test))
    e_had = ref.rel_err(ref.quantize_dequantize(had.rotate_k(test), 3, 0.96), had.rotate_k(test))
    assert e_cal <= e_had * 1.02, (e_cal, e_had)


# ----------------------------------------------------------------------------------------- capacity

def test_capacity_reproduces_the_reported_pools():
    """vLLM 0.32's hybrid accounting at report 002's settings gives each reported pool exactly, and one
    KV budget per GPU gives report 002's same-day K2V2 and K3V2 pools together."""
    for r in capacity.reconcile():
        assert r["kv_bytes_lo"] is not None, r["label"]
        assert 2.0 * capacity.GIB < r["kv_bytes_lo"] < 3.2 * capacity.GIB  # 12 GB card, 0.72, 4.4-5.2 GiB weights
    rows = {r["format"]: r for r in capacity.capacity_table()}
    assert rows["k3v2"]["pool"] == 378652 and rows["k2v2"]["pool"] == 458752
    assert rows["k3v2"]["block_size"] == 2464 and rows["k3v2"]["blocks_per_request"] == 54 + 3 * 3
    # the pool order the format sizes imply, and the GDN blocks charged to it (pool < naive arithmetic)
    pools = [rows[f]["pool"] for f in ("bf16", "turboquant_4bit_nc", "turboquant_k3v4_nc", "k3v2", "k2v2")]
    assert pools == sorted(pools)
    assert all(r["pool"] < r["naive_pool"] for r in rows.values())
    # GDN state per layer per sequence per GPU (docs/design.md §1: ~0.8 MB in bf16), with the MTP column
    assert capacity.gdn_state_bytes() == (5120 * 4 + 24 * 128 * 128) * 2
    # SSD embeddings: same K2V2 geometry, more blocks
    iv = capacity.kv_budget_interval("k2v2", 627633)
    assert iv and iv[2] == 249


def test_capacity_arithmetic_of_design():
    """docs/design.md §1's naive figures: 282,089 × 8,384 B; 458,752 × 4,352 B; 378,652 × 5,376 B."""
    per_gpu = {f: 16 * 2 * capacity.KV_BYTES[f] for f in capacity.KV_BYTES}
    assert per_gpu["turboquant_4bit_nc"] == 8384 and per_gpu["k2v2"] == 4352 and per_gpu["k3v2"] == 5376
    assert capacity.naive_pool("k3v2", 378652 * 5376) == 378652
