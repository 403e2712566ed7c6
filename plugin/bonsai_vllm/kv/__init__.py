"""Quantized KV cache for the 16 full-attention layers: rotate, K 3-bit / V 2-bit, bf16 sinks + recent window.

vLLM-free (torch, safetensors, optional Triton). Modules, each kernel beside its PyTorch reference:

    format.py     KVFormat (bits, clipping, window, sinks), the page layout; K3V2 = 168 B per token per KV head
    rotation.py   KVRotation: randomized Hadamard per layer (default) or a calibrated file (OSCAR style)
    reference.py  quantize / pack / store_ref / gather_ref / decode_ref / attention (the judge), TurboQuant
                  k3v4 reference for comparison
    kernels/      Triton: store.py (quantize + pack + scatter into pages)          ~ reference.store_ref
                  decode.py (all query heads of a KV head per program, split-KV + LSE merge with the
                  bf16 part)                                                         ~ reference.decode_ref
    paged.py      PagedK3V2: vLLM's paged layout (one page per block and KV head), decode / verify / prefill
    calibration.py  bonsai-kv-calibrate: samples captured while serving -> a calibrated rotation file
    cache.py      LayerKVCache: pages + bf16 buffer bookkeeping, kernels or reference
    capacity.py   KV pool of the 27B on 2 × 12 GB per format, vLLM 0.32's accounting

Typical use (one layer)::

    from bonsai_vllm.kv import K3V2, KVRotation, LayerKVCache
    layer = LayerKVCache(K3V2, KVRotation.randomized_hadamard(layer_idx, 4, 256), num_kv_heads=4,
                         block_size=2464, num_blocks=..., max_batch=..., device="cuda", use_kernels=True)
    layer.append(b, k, v)              # k, v [T, Hkv, D] post-RoPE
    o = layer.attend(q, sm_scale)      # q [B, QL, Hq, D] -> [B, QL, Hq, D] float32

Kernel entry points (rotated inputs): `kernels.store.store(cache, k_rot, v_rot, slots, fmt, block_size)` and
`kernels.decode.decode(q_rot, cache, block_table, n_quant, win_k, win_v, n_win, fmt, block_size, sm_scale)`.
They are imported lazily (they define @triton.jit functions at import).
"""

from bonsai_vllm.kv.cache import LayerKVCache
from bonsai_vllm.kv.format import FORMATS, K2V2, K3V2, KVFormat
from bonsai_vllm.kv.rotation import KVRotation, calibrate

__all__ = ["FORMATS", "K2V2", "K3V2", "KVFormat", "KVRotation", "LayerKVCache", "calibrate"]
