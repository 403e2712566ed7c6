"""The int8 all-reduce for prefill-sized payloads (report 002 §5), in plain PyTorch.

The field reports cited here are described in docs/field-reports.md.

Under TP=2 every row-parallel layer ends in an all-reduce of a [tokens, 5120] partial sum: two per layer,
128 per step. Without P2P (GeForce under WSL2) those bytes cross PCIe through host memory, and in a
prefill step they are half the step's time (report 000 §6). Sending int8 with one scale per 128 elements
instead of bf16 nearly halves the bytes:

    per rank: pack(x) = [int8 codes (n bytes) | fp32 scales (n/128 × 4 bytes)]  → one all-gather
    every rank: y = Σ_r dequant(pack_r), summed in float32 in rank order

Every rank sums the same dequantized parts in the same order, so all ranks hold bit-identical results
(keeping one's own part exact would make the ranks' copies of the hidden state drift apart).
Decode-sized payloads stay on the ordinary bf16 all-reduce: they are latency-bound, not byte-bound.

The gather is a callable, so this module stays free of vLLM; the adapter passes the TP group's.
"""

from __future__ import annotations

from typing import Callable

import torch

GROUP = 128  # elements per int8 scale
# gather(t) -> [world, *t.shape]: every rank's t, in rank order.
GatherBytes = Callable[[torch.Tensor], torch.Tensor]


def quantize_int8(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] → codes int8 [..., n], scales float32 [..., n/group]; scale = absmax / 127."""
    n = x.shape[-1]
    if n % group:
        raise ValueError(f"int8 all-reduce: last dimension {n} is not a multiple of the group size {group}")
    xg = x.float().reshape(*x.shape[:-1], n // group, group)  # [..., groups, group]
    scale = xg.abs().amax(dim=-1) / 127.0  # [..., groups]
    # An all-zero group gets scale 0 and codes 0 (no 0/0).
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(xg * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(x.shape), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """codes int8 [..., n], scales [..., n/group] → float32 [..., n]."""
    n = q.shape[-1]
    qg = q.float().reshape(*q.shape[:-1], n // group, group)
    return (qg * scale.unsqueeze(-1)).reshape(q.shape)


def pack(x: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """x [rows, n] → one uint8 buffer [rows·n + rows·(n/group)·4]: codes then fp32 scales."""
    q, scale = quantize_int8(x, group)
    return torch.cat([q.reshape(-1).view(torch.uint8), scale.reshape(-1).view(torch.uint8)])


def unpack_sum(packed: torch.Tensor, shape: tuple[int, int], group: int = GROUP) -> torch.Tensor:
    """[world, bytes] of every rank's pack → float32 [rows, n], the sum over ranks in rank order."""
    rows, n = shape
    codes = rows * n
    total = torch.zeros(shape, dtype=torch.float32, device=packed.device)
    for r in range(packed.shape[0]):
        q = packed[r, :codes].view(torch.int8).reshape(rows, n)
        scale = packed[r, codes:].contiguous().view(torch.float32).reshape(rows, n // group)
        total += dequantize_int8(q, scale, group)
    return total


def int8_all_reduce(x: torch.Tensor, gather: GatherBytes, group: int = GROUP) -> torch.Tensor:
    """Sum of `x` over all ranks, exchanged as int8 with per-`group` scales; returns x's dtype and shape."""
    flat = x.reshape(-1, x.shape[-1])  # [rows, n]
    gathered = gather(pack(flat, group))  # [world, bytes]
    return unpack_sum(gathered, tuple(flat.shape), group).to(x.dtype).reshape(x.shape)


def error_bound(parts: list[torch.Tensor], group: int = GROUP) -> torch.Tensor:
    """Elementwise bound on |int8_all_reduce − exact sum|: half a quantization step of each rank's group.

    Each rank's value is off by at most scale/2 = absmax(group)/254, plus float32 rounding of the sum.
    """
    bound = torch.zeros_like(parts[0], dtype=torch.float32)
    for p in parts:
        pg = p.float().reshape(*p.shape[:-1], p.shape[-1] // group, group)
        step = (pg.abs().amax(dim=-1, keepdim=True) / 127.0).expand_as(pg).reshape(p.shape)
        bound += step / 2
    exact = torch.stack([p.float() for p in parts]).sum(0)
    return bound + exact.abs() * 4 * torch.finfo(torch.float32).eps
