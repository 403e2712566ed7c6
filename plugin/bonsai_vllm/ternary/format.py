"""The `prism_ternary` checkpoint format: 2-bit code packing, sign vectors, the quantization_config.

This is the format of the published vLLM checkpoint of Ternary-Bonsai-2-27B (docs/format.md):

- Ternary modules (vLLM's fused names, see `TERNARY_MODULES`) store `.weight` int32 [out, in/16]
  holding 16 two-bit codes per word, code i at bits 2i (little-endian), value = code - 1
  (0b00 = -1, 0b01 = 0, 0b10 = +1, 0b11 unused), and `.scales` fp16 [out, in/group_size].
- `quantization_config.signs[str(width)]` is base64 of `numpy.packbits(sign < 0)`: one ±1 vector per
  input width, shared by every layer of that width; bit 1 means -1.

Plain PyTorch and numpy: no vLLM import, so it runs anywhere (CPU tests, GPU boxes without vLLM).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field

import numpy as np
import torch

QUANT_METHOD = "prism_ternary"

# Last component of a vLLM module prefix whose weights are ternary in the checkpoint.
TERNARY_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "in_proj_qkvz", "out_proj", "lm_head")

CODES_PER_WORD = 16  # 32 bits / 2 bits per code

# The one layout we read and write; anything else is refused rather than silently mis-decoded.
SUPPORTED_BITS = 2
SUPPORTED_GROUP_SIZE = 128


def is_ternary_module(prefix: str) -> bool:
    """True when the last component of a dotted module prefix names a ternary module.

    Pure name check: whether `mtp.*` (bf16 in the published checkpoint) counts is the caller's decision.
    """
    return prefix.rsplit(".", 1)[-1] in TERNARY_MODULES


# --------------------------------------------------------------------------------------------- packing

# Bit offset of code i inside its int32 word.
_SHIFTS = torch.arange(CODES_PER_WORD, dtype=torch.int64) * 2


def pack_ternary(values: torch.Tensor) -> torch.Tensor:
    """Pack ternary values {-1, 0, +1} of shape [..., in] (in % 16 == 0) into int32 [..., in/16]."""
    if values.shape[-1] % CODES_PER_WORD:
        raise ValueError(f"pack_ternary: last dimension {values.shape[-1]} is not a multiple of "
                         f"{CODES_PER_WORD}; pad the input width to a multiple of {CODES_PER_WORD}")
    if values.is_floating_point() or values.is_complex():
        raise ValueError(f"pack_ternary: expected an integer tensor of -1/0/+1, got {values.dtype}; "
                         "round and cast it (e.g. .to(torch.int8)) first")
    v = values.to(torch.int64)
    if ((v < -1) | (v > 1)).any():
        bad = v[(v < -1) | (v > 1)].unique()[:8].tolist()
        raise ValueError(f"pack_ternary: values must be in {{-1, 0, +1}}, found {bad}")
    # Work in int64 so that code 2 at bits 30-31 does not overflow, then wrap to two's complement int32.
    codes = (v + 1).reshape(*v.shape[:-1], -1, CODES_PER_WORD)  # [..., in/16, 16]
    words = (codes << _SHIFTS.to(v.device)).sum(dim=-1)  # [..., in/16]; bit fields never overlap
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_ternary(packed: torch.Tensor) -> torch.Tensor:
    """Unpack int32 [..., n] into int8 values {-1, 0, +1} of shape [..., 16n].

    No data-dependent check here (it would sync the GPU and break CUDA-graph capture on the forward
    path): the unused code 0b11 would decode to +2. `check_module_tensors` rejects it at load time.
    """
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack_ternary: expected int32 words, got {packed.dtype}")
    shifts = _SHIFTS.to(device=packed.device, dtype=torch.int32)
    # Arithmetic right shift of a negative word smears the sign bit, but the mask keeps only our 2 bits.
    codes = (packed.unsqueeze(-1) >> shifts) & 3  # [..., n, 16]
    return (codes - 1).to(torch.int8).reshape(*packed.shape[:-1], -1)


def count_unused_codes(packed: torch.Tensor) -> int:
    """Number of 0b11 codes (unused by the format) in int32 words: a corrupt or foreign weight if > 0."""
    # A field holds 0b11 iff its low bit and its high bit are both set; 0x55555555 keeps the low bits.
    # (The arithmetic shift copies bit 31 into bit 30's place, which is exactly field 15's high bit.)
    both = packed & (packed >> 1) & 0x55555555
    hit = both[both != 0]  # usually empty: the clean path costs one pass
    if hit.numel() == 0:
        return 0
    return int(((hit.unsqueeze(-1) >> _SHIFTS.to(device=hit.device, dtype=torch.int32)) & 1).sum())


# ------------------------------------------------------------------------------------------- signs


def encode_signs(signs: torch.Tensor) -> str:
    """Base64 of numpy.packbits(sign < 0) (numpy's default big-endian bit order); bit 1 means -1."""
    s = signs.detach().to("cpu", torch.float32).reshape(-1)
    if not bool(((s == 1) | (s == -1)).all()):
        raise ValueError("encode_signs: a sign vector must hold only +1 and -1")
    return base64.b64encode(np.packbits((s < 0).numpy()).tobytes()).decode("ascii")


def decode_signs(b64: str, width: int) -> torch.Tensor:
    """Decode a base64 sign string into a float32 ±1 vector of length `width`."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"decode_signs: sign vector for width {width} is not valid base64 ({e})") from e
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8))
    want_bytes = -(-width // 8)
    if len(raw) != want_bytes:
        raise ValueError(f"decode_signs: sign vector for width {width} decodes to {len(raw)} bytes "
                         f"({bits.size} bits), expected {want_bytes}; it belongs to another width or "
                         "is truncated: re-export the signs with numpy.packbits of the full vector")
    if bits[width:].any():
        raise ValueError(f"decode_signs: sign vector for width {width} has non-zero padding bits after "
                         f"bit {width}; it was packed for a wider vector")
    return torch.from_numpy(1.0 - 2.0 * bits[:width].astype(np.float32))


# ------------------------------------------------------------------------------------------ config


def _need_int(d: dict, key: str) -> int:
    if key not in d:
        raise ValueError(f"prism_ternary quantization_config is missing '{key}'; "
                         f"expected keys quant_method, bits, group_size, hadamard_block, signs")
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"prism_ternary quantization_config '{key}' must be an integer, got {value!r}")
    return value


@dataclass
class PrismTernaryConfig:
    """The checkpoint's `quantization_config`; validated on construction, signs decoded once."""

    bits: int
    group_size: int
    hadamard_block: int
    signs: dict[int, str]
    _sign_cache: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.bits != SUPPORTED_BITS:
            raise ValueError(f"prism_ternary: bits = {self.bits} is not supported; only bits = "
                             f"{SUPPORTED_BITS} (ternary codes in 2-bit fields) is. Re-export the "
                             "checkpoint with 2-bit ternary codes")
        if self.group_size != SUPPORTED_GROUP_SIZE:
            raise ValueError(f"prism_ternary: group_size = {self.group_size} is not supported; only "
                             f"group_size = {SUPPORTED_GROUP_SIZE} (one fp16 scale per 128 weights) is")
        hb = self.hadamard_block
        if hb <= 0 or hb & (hb - 1) or hb % self.group_size:
            raise ValueError(f"prism_ternary: hadamard_block = {hb} is not supported; it must be a power "
                             f"of two and a multiple of group_size {self.group_size} (1024 in the "
                             "published checkpoint)")
        for width, b64 in self.signs.items():
            if isinstance(width, bool) or not isinstance(width, int) or width <= 0:
                raise ValueError(f"prism_ternary: signs key {width!r} is not a positive integer width")
            if not isinstance(b64, str):
                raise ValueError(f"prism_ternary: signs['{width}'] must be a base64 string, "
                                 f"got {type(b64).__name__}")
            # Decode now: a bad sign string should fail at load time, not at the first forward pass.
            self._sign_cache[width] = decode_signs(b64, width)

    @classmethod
    def from_dict(cls, d: dict) -> PrismTernaryConfig:
        """Read the published keys of config.json's `quantization_config`."""
        method = d.get("quant_method")
        if method != QUANT_METHOD:
            raise ValueError(f"quant_method = {method!r} is not '{QUANT_METHOD}'; this reader only "
                             "handles prism_ternary checkpoints")
        signs = d.get("signs")
        if not isinstance(signs, dict) or not signs:
            raise ValueError(f"prism_ternary quantization_config 'signs' must be a non-empty mapping from "
                             f"input width (string) to base64, got {signs!r}")
        parsed: dict[int, str] = {}
        for key, b64 in signs.items():
            try:
                parsed[int(key)] = b64
            except (TypeError, ValueError):
                raise ValueError(f"prism_ternary: signs key {key!r} is not an input width such as "
                                 "\"5120\"") from None
        return cls(bits=_need_int(d, "bits"), group_size=_need_int(d, "group_size"),
                   hadamard_block=_need_int(d, "hadamard_block"), signs=parsed)

    def to_dict(self) -> dict:
        return {"quant_method": QUANT_METHOD, "bits": self.bits, "group_size": self.group_size,
                "hadamard_block": self.hadamard_block,
                "signs": {str(w): self.signs[w] for w in sorted(self.signs)}}

    def sign_vector(self, width: int) -> torch.Tensor:
        """The float32 ±1 vector [width] for an input width (the full, unpartitioned width)."""
        vec = self._sign_cache.get(width)
        if vec is None:
            raise ValueError(f"prism_ternary: no sign vector for input width {width}; the checkpoint has "
                             f"widths {sorted(self.signs)}. A module of this width cannot be ternary in "
                             "this checkpoint: check the model config against the checkpoint")
        return vec


def check_module_tensors(name: str, weight: torch.Tensor, scales: torch.Tensor, out_features: int,
                         in_features: int, cfg: PrismTernaryConfig, *,
                         in_features_per_partition: int | None = None) -> None:
    """Raise ValueError unless a ternary module's tensors match the format.

    `in_features` is the full input width, which must be a multiple of the Hadamard block. Under tensor
    parallelism a row-parallel rank holds only `in_features_per_partition` columns (e.g. 17408 -> 8704):
    pass it and the shapes are checked against that width instead. Also scans the codes for the unused
    0b11 (one pass over the weight; call it at load time, not per forward).
    """
    if in_features % cfg.hadamard_block:
        raise ValueError(f"{name}: input width {in_features} is not a multiple of hadamard_block "
                         f"{cfg.hadamard_block}; a prism_ternary module needs whole Hadamard blocks "
                         "(keep this module dense)")
    width = in_features if in_features_per_partition is None else in_features_per_partition
    if width % cfg.group_size:
        raise ValueError(f"{name}: input width {width} (this partition) is not a multiple of group_size "
                         f"{cfg.group_size}; this tensor-parallel split cannot cut the scales")
    in_features = width
    want_w = (out_features, in_features // CODES_PER_WORD)
    if weight.dtype != torch.int32 or tuple(weight.shape) != want_w:
        raise ValueError(f"{name}.weight: expected int32 {list(want_w)} (16 two-bit codes per word), got "
                         f"{str(weight.dtype).removeprefix('torch.')} {list(weight.shape)}; the checkpoint "
                         "does not match the model config or is not prism_ternary-packed")
    want_s = (out_features, in_features // cfg.group_size)
    if scales.dtype != torch.float16 or tuple(scales.shape) != want_s:
        raise ValueError(f"{name}.scales: expected float16 {list(want_s)} (one scale per "
                         f"{cfg.group_size} inputs), got {str(scales.dtype).removeprefix('torch.')} "
                         f"{list(scales.shape)}; the checkpoint does not match the model config")
    bad = count_unused_codes(weight)
    if bad:
        raise ValueError(f"{name}.weight: {bad} two-bit codes are 0b11, which prism_ternary leaves unused "
                         "(0b00 = -1, 0b01 = 0, 0b10 = +1); the weight is corrupt or packed another way")
