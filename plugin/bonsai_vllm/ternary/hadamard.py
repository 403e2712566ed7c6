"""Blockwise fast Walsh-Hadamard transform (normalized, Sylvester order), the rotation of prism_ternary.

The checkpoint stores W' = (W · diag(s)) · H per Hadamard block of the input, so a layer computes
y = W' · H(s ⊙ x). H is symmetric and orthonormal (H · H = I), which lets the same transform rotate
activations at run time and weights at conversion time.

Sylvester H_n = H_2 ⊗ H_2 ⊗ ... ⊗ H_2: each butterfly stage applies H_2 to one bit of the index, so
log2(block) stages of (a + b, a - b) over reshaped views compute it in O(n log n) without a matrix.
"""

from __future__ import annotations

import torch


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
