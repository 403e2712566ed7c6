"""Reference maths of a prism_ternary linear layer, in plain float32 PyTorch.

Slow and simple on purpose: this is the judge that GPU kernels (and the vLLM adapter) are tested against.

- `ternary_linear_ref`: y = H(s ⊙ x) · W'^T (+ bias), W' = code × scale of its 128-group.
- `int8_decompose` / `ternary_linear_int8_ref`: report 000 §4's exact int8 prefill path
  (docs/field-reports.md). Each group scale
  s[n, g] becomes an int8 multiple q[n, g] of a per-row step smax[n]/127, so code × q is an int8 weight and
  the whole layer is one int8 × int8 → int32 matmul, rescaled by (token scale × row scale).

The rotation itself (`fwht`, `signed_block_hadamard`): the blockwise fast Walsh-Hadamard transform,
normalized, in Sylvester order. The checkpoint stores W' = (W · diag(s)) · H per Hadamard block of the
input, so a layer computes y = W' · H(s ⊙ x); H is symmetric and orthonormal (H · H = I), which lets the
same transform rotate activations at run time and weights at conversion time. Sylvester H_n = H_2 ⊗ … ⊗ H_2:
each butterfly stage applies H_2 to one bit of the index, so log2(block) stages of (a + b, a - b) over
reshaped views compute it in O(n log n) without a matrix.
"""

from __future__ import annotations

import torch

from bonsai_vllm.ternary.format import unpack_ternary


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # float32 for bf16/fp16/fp32 inputs; float64 inputs stay float64 so exactness tests can use it.
    return torch.float64 if dtype == torch.float64 else torch.float32


def fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """Normalized Walsh-Hadamard transform of each consecutive `block`-wide slice of the last dim."""
    if block <= 0 or block & (block - 1):
        raise ValueError(f"fwht: block = {block} must be a power of two")
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"fwht: last dimension {n} is not a multiple of the Hadamard block {block}")
    shape = x.shape
    y = x.to(_compute_dtype(x.dtype)).reshape(-1, block)  # [rows * n/block, block]
    h = 1
    while h < block:
        # Pairs (i, i + h) inside each 2h-wide run. Functional ops only (no out= or in-place), so vLLM's
        # torch.compile can trace this inside the model's forward.
        yv = y.view(-1, block // (2 * h), 2, h)
        a, b = yv[:, :, 0], yv[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, block)
        h *= 2
    return (y * block ** -0.5).reshape(shape).to(x.dtype)


def signed_block_hadamard(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """fwht(x ⊙ signs, block): the activation rotation H(s ⊙ x); returns x's dtype."""
    if signs.shape[-1] != x.shape[-1]:
        raise ValueError(f"signed_block_hadamard: sign vector width {signs.shape[-1]} does not match the "
                         f"input width {x.shape[-1]}")
    ct = _compute_dtype(x.dtype)
    return fwht(x.to(ct) * signs.to(device=x.device, dtype=ct), block).to(x.dtype)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense normalized Sylvester Hadamard matrix [n, n]; for tests and small n only."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: n = {n} must be a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(h2, h)
    return (h / n ** 0.5).to(dtype)


def _group_scales(scales: torch.Tensor, n_in: int, group_size: int) -> torch.Tensor:
    """Expand fp16 scales [out, in/group] to float32 [out, in], checking they fit the weight."""
    if scales.shape[-1] * group_size != n_in:
        raise ValueError(f"scales have {scales.shape[-1]} groups of {group_size} but the weight has "
                         f"{n_in} inputs; expected {n_in // group_size} groups")
    return scales.float().repeat_interleave(group_size, dim=-1)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """W' [out, in] float32 = code value × scale of its group (still in the rotated domain)."""
    codes = unpack_ternary(packed)  # int8 [out, in]
    return codes.float() * _group_scales(scales, codes.shape[-1], group_size)


def ternary_linear_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, signs: torch.Tensor,
                       group_size: int, block: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., out] = H(s ⊙ x) @ W'^T (+ bias), computed in float32, returned in x's dtype."""
    w = dequantize(packed, scales, group_size).to(x.device)  # [out, in]
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"ternary_linear_ref: input width {x.shape[-1]} != weight input width {w.shape[-1]}")
    xr = signed_block_hadamard(x.float(), signs, block)  # [..., in]
    y = xr @ w.t()  # [..., out]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def int8_decompose(packed: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split W' into int8 [out, in] (= code × q[n, g]) and a float32 row scale [out] (= smax / 127).

    q[n, g] = round(127 · s[n, g] / smax[n]), smax[n] = max_g |s[n, g]|, so |q| <= 127 and
    W' ≈ w_int8 × row_scale with a per-group relative error of at most 0.5/127 of smax[n].
    """
    codes = unpack_ternary(packed)  # int8 [out, in]
    s = scales.float()  # [out, groups]
    if s.shape[-1] * group_size != codes.shape[-1]:
        raise ValueError(f"scales have {s.shape[-1]} groups of {group_size} but the weight has "
                         f"{codes.shape[-1]} inputs")
    smax = s.abs().amax(dim=-1)  # [out]
    # An all-zero row has nothing to scale: q = 0 and row_scale = 0 instead of 0/0.
    q = torch.round(127.0 * s / smax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1))  # [out, groups]
    q = q.repeat_interleave(group_size, dim=-1)  # [out, in]
    w_int8 = (codes.float() * q).to(torch.int8)
    return w_int8, smax / 127.0


def _int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int32 a [M, K] @ b[N, K]^T of int8 operands."""
    try:
        # torch._int_mm wants the second operand column-major, which b.t() is (docs/design.md §4).
        return torch._int_mm(a, b.t())
    except RuntimeError:
        # Shapes _int_mm refuses (e.g. M <= 16 on CUDA): float64 holds every partial sum exactly,
        # since |sum| <= K · 127² < 2^53.
        return (a.double() @ b.double().t()).to(torch.int32)


def ternary_linear_int8_ref(x: torch.Tensor, w_int8: torch.Tensor, row_scale: torch.Tensor,
                            signs: torch.Tensor, block: int) -> torch.Tensor:
    """Int8 prefill path: rotate, int8 per-token activations (absmax/127), exact int32 matmul, rescale."""
    lead = x.shape[:-1]
    xr = signed_block_hadamard(x.float(), signs, block).reshape(-1, x.shape[-1])  # [M, in]
    amax = xr.abs().amax(dim=-1, keepdim=True)  # [M, 1]
    tok_scale = amax / 127.0
    xq = torch.round(xr / tok_scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-127, 127)
    acc = _int8_matmul(xq.to(torch.int8), w_int8.to(xq.device))  # int32 [M, out]
    y = acc.float() * tok_scale * row_scale.to(xq.device).float()  # [M, out]
    return y.reshape(*lead, -1).to(x.dtype)
