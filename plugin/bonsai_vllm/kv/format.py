"""The quantized KV format: bits, clipping, the bf16 recent window, and where every byte of a page lives.

One KV vector (one token, one KV head, head_dim D) is rotated (rotation.py), then each of K and V is
quantized with its own asymmetric scalar quantizer: one fp16 scale and one fp16 minimum per vector,
codes q = round((x - min) / scale) in [0, 2^bits - 1], dequantized as q·scale + min. Bytes per token per
KV head at D = 256:

    K3V2: 96 (3-bit K) + 64 (2-bit V) + 8 (fp16 scale+min for K and for V) = 168
    K2V2: 64 + 64 + 8 = 136

Page layout (what the kernels read). The cache of one layer is uint8 [num_blocks, num_kv_heads, PAGE]
with PAGE = block_size · slot_bytes; inside one (block, head) page the sections are planar, each row
of a section one token, so a tile of tokens of one section is one contiguous, 16-byte aligned run:

    K_LO  block_size × D/4   2-bit planes: byte j holds dims j, j+P, j+2P, j+3P (P = D/4) at bits 0,2,4,6
    K_HI  block_size × D/8   (3-bit K only) the third bit: byte j holds dims j + (P/2)·p at bit p, p < 8
    V     block_size × D/4   like K_LO
    META  block_size × 8     fp16 k_scale, k_min, v_scale, v_min

Why planar 2-bit "pieces" (dim = P·i + j at bits 2i of byte j) rather than consecutive codes per byte:
a kernel that loads a [tokens, P] tile of bytes gets, for each i, the codes of dims P·i … P·i+P-1 with one
mask, in natural dim order: four dot products of width P need no reshuffling of registers. The third
bit of dim P·i + j sits in byte j mod P/2 at bit 2i + (j >= P/2), i.e. also a fixed mask per column.

The bf16 part: the first `sink` tokens of each sequence (attention sinks) and its newest `window` tokens
stay in bf16 (rotated), in one buffer [sinks | recent]; when the recent part reaches window + flush
tokens the oldest `flush` are quantized into pages in one batch. Attention is computed over both parts
(pages, bf16 buffer) and merged by log-sum-exp. Without the bf16 part, one port measured gsm8k 61.8
against 74.9 for bf16; with it, parity (docs/design.md §1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Sorted-|x| fraction the clipping threshold is taken at (the OSCAR reference's K 0.96, V 0.92): the
# threshold is the value at 0-based index ceil(clip·D) - 1 of sorted |x|; clip = 1.0 disables clipping.
DEFAULT_K_CLIP = 0.96
DEFAULT_V_CLIP = 0.92
META_BYTES = 8  # fp16 k_scale, k_min, v_scale, v_min


@dataclass(frozen=True)
class KVFormat:
    """A quantized KV format. Kernels support k_bits in {2, 3}, v_bits == 2, D a power of two >= 64."""

    name: str = "k3v2"
    k_bits: int = 3
    v_bits: int = 2
    head_dim: int = 256
    k_clip: float = DEFAULT_K_CLIP
    v_clip: float = DEFAULT_V_CLIP
    window: int = 128  # recent tokens kept in bf16 per sequence
    flush: int = 64  # tokens quantized at once when the window overflows
    sink: int = 4  # first tokens of each sequence kept in bf16 for good (attention sinks)

    def __post_init__(self):
        d = self.head_dim
        if d < 64 or d & (d - 1):
            raise ValueError(f"KVFormat: head_dim {d} must be a power of two >= 64")
        if self.k_bits not in (2, 3) or self.v_bits != 2:
            raise ValueError(f"KVFormat: supported bits are K 2 or 3 and V 2, got K{self.k_bits}V{self.v_bits}")
        for c in (self.k_clip, self.v_clip):
            if not 0.0 < c <= 1.0:
                raise ValueError(f"KVFormat: clip fractions must be in (0, 1], got {c}")
        if self.window < 0 or self.flush < 1 or self.sink < 0:
            raise ValueError("KVFormat: window and sink must be >= 0, flush >= 1")

    # --- bytes of one token of one KV head, by section
    @property
    def k_lo_bytes(self) -> int:
        return self.head_dim // 4

    @property
    def k_hi_bytes(self) -> int:
        return self.head_dim // 8 if self.k_bits == 3 else 0

    @property
    def v_bytes(self) -> int:
        return self.head_dim // 4

    @property
    def slot_bytes(self) -> int:
        """Bytes per token per KV head: 168 for K3V2 at D = 256, 136 for K2V2."""
        return self.k_lo_bytes + self.k_hi_bytes + self.v_bytes + META_BYTES

    # --- section offsets inside one (block, head) page of `block_size` tokens
    def offsets(self, block_size: int) -> dict[str, int]:
        k_hi = block_size * self.k_lo_bytes
        v = k_hi + block_size * self.k_hi_bytes
        meta = v + block_size * self.v_bytes
        return {"k_lo": 0, "k_hi": k_hi, "v": v, "meta": meta, "page": meta + block_size * META_BYTES}

    def kernel_offsets(self, block_size: int) -> dict[str, int]:
        """The same offsets as the Triton kernels take them (constexpr arguments); the one place they come from."""
        o = self.offsets(block_size)
        return {"OFF_HI": o["k_hi"], "OFF_V": o["v"], "OFF_META": o["meta"]}

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.slot_bytes

    def with_(self, **kw) -> "KVFormat":
        return replace(self, **kw)

    def clip_index(self, clip: float) -> int:
        """0-based index into sorted |x| of the clipping threshold, or -1 for no clipping."""
        if clip >= 1.0:
            return -1
        import math

        return max(0, math.ceil(clip * self.head_dim) - 1)


K3V2 = KVFormat("k3v2", 3, 2)
K2V2 = KVFormat("k2v2", 2, 2)
FORMATS = {"k3v2": K3V2, "k2v2": K2V2}
