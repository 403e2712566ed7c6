"""Dense weight <-> prism_ternary tensors: rotate, ternarize per 128-group, and back.

quantize_dense: W' = (W · diag(s)) · H blockwise along the input, i.e. each row r -> fwht(s ⊙ r)
(H is symmetric), then per group of 128 rotated weights:
    threshold t = mean |w'|                (BitNet b1.58's absmean)
    codes      = round(clamp(w' / t, -1, 1))
    scale      = mean |w'| over the group's non-zero codes, fp16-rounded
The scale refit is the least-squares scale for the chosen codes, so it never does worse than t itself,
and a group that already is code × scale comes back exactly (t alone would shrink it by nnz/128).

dense_from_ternary: the effective dense weight W' · H · diag(s) (each row r' -> s ⊙ fwht(r')), so that
x @ dense.T == H(s ⊙ x) @ W'^T, the layer's output.
"""

from __future__ import annotations

import torch

from bonsai_vllm.ternary.format import pack_ternary
from bonsai_vllm.ternary.reference import fwht
from bonsai_vllm.ternary.reference import dequantize

_FP16_MAX = torch.finfo(torch.float16).max


def quantize_dense(weight: torch.Tensor, signs: torch.Tensor, group_size: int,
                   block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [out, in] -> (packed int32 [out, in/16], scales fp16 [out, in/group_size])."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_dense: expected a 2-D weight [out, in], got shape {list(weight.shape)}")
    n_out, n_in = weight.shape
    if n_in % block or block % group_size:
        raise ValueError(f"quantize_dense: input width {n_in} must be a multiple of the Hadamard block "
                         f"{block}, itself a multiple of group_size {group_size}")
    if signs.shape != (n_in,):
        raise ValueError(f"quantize_dense: sign vector has shape {list(signs.shape)}, expected [{n_in}]")
    w = weight.float() * signs.to(weight.device, torch.float32)  # W · diag(s)
    w = fwht(w, block)  # [out, in], rows r -> H(s ⊙ r)
    g = w.reshape(n_out, n_in // group_size, group_size)  # [out, groups, group]
    thresh = g.abs().mean(dim=-1, keepdim=True)  # [out, groups, 1]
    # All-zero group: threshold 0 would give 0/0; any positive divisor yields codes 0, scale 0.
    codes = torch.round(torch.clamp(g / thresh.clamp_min(torch.finfo(torch.float32).tiny), -1, 1))
    nnz = codes.abs().sum(dim=-1)  # [out, groups]
    scales = (g.abs() * codes.abs()).sum(dim=-1) / nnz.clamp_min(1)  # least-squares scale per group
    if not bool(torch.isfinite(scales).all()) or bool((scales > _FP16_MAX).any()):
        raise ValueError(f"quantize_dense: a group scale is not finite in fp16 (max {scales.max().item():g}); "
                         "the weight holds inf/nan or values beyond fp16 range")
    packed = pack_ternary(codes.to(torch.int8).reshape(n_out, n_in))
    return packed, scales.to(torch.float16)


def dense_from_ternary(packed: torch.Tensor, scales: torch.Tensor, signs: torch.Tensor, group_size: int,
                       block: int) -> torch.Tensor:
    """Effective dense weight float32 [out, in] = W' · H · diag(s) of stored prism_ternary tensors."""
    w = dequantize(packed, scales, group_size)  # [out, in], rotated domain
    return fwht(w, block) * signs.to(w.device, torch.float32)
