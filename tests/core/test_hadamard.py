"""ternary/reference.py against scipy's Sylvester Hadamard matrix (an independent construction)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from bonsai_vllm.ternary.reference import fwht, hadamard_matrix, signed_block_hadamard

SIZES = [16, 32, 64, 128, 256, 512, 1024]


def _scipy_h(n: int) -> torch.Tensor:
    return torch.from_numpy(scipy.linalg.hadamard(n).astype(np.float64) / np.sqrt(n))


def _blockwise(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Dense reference: each consecutive n-wide slice of the last dim times H (symmetric)."""
    n = h.shape[0]
    return (x.reshape(*x.shape[:-1], -1, n) @ h).reshape(x.shape)


@pytest.mark.parametrize("n", SIZES)
def test_fwht_matches_scipy_float64(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, 3 * n, generator=gen, dtype=torch.float64)  # three blocks per row
    torch.testing.assert_close(fwht(x, n), _blockwise(x, _scipy_h(n)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [16, 1024])
def test_fwht_matches_scipy_float32_and_leading_dims(n):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 2 * n, generator=gen)
    y = fwht(x, n)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y.double(), _blockwise(x.double(), _scipy_h(n)), rtol=0, atol=1e-5)


def test_fwht_blocks_are_independent():
    # A spike in block 1 must not leak into blocks 0 or 2.
    x = torch.zeros(1, 3 * 64)
    x[0, 64 + 5] = 1.0
    y = fwht(x, 64)
    assert torch.all(y[0, :64] == 0) and torch.all(y[0, 128:] == 0)
    torch.testing.assert_close(y[0, 64:128].double(), _scipy_h(64)[5], rtol=0, atol=1e-7)


@pytest.mark.parametrize("n", SIZES)
def test_hadamard_matrix_is_scipy_and_involutive(n):
    h = hadamard_matrix(n, torch.float64)
    torch.testing.assert_close(h, _scipy_h(n), rtol=0, atol=0)
    torch.testing.assert_close(h @ h, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)


def test_fwht_is_its_own_inverse():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 2048, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(fwht(fwht(x, 1024), 1024), x, rtol=0, atol=1e-12)


def test_fwht_keeps_dtype_and_input():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 1024, generator=gen)
    before = x.clone()
    y = fwht(x.to(torch.bfloat16), 1024)
    assert y.dtype == torch.bfloat16
    fwht(x, 1024)
    assert torch.equal(x, before)  # the float32 input is not transformed in place


def test_signed_block_hadamard_is_h_of_signed_x():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 2048, generator=gen, dtype=torch.float64)
    s = torch.randint(0, 2, (2048,), generator=gen).double() * 2 - 1
    torch.testing.assert_close(signed_block_hadamard(x, s, 1024), _blockwise(x * s, _scipy_h(1024)),
                               rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="sign vector width 1024"):
        signed_block_hadamard(x, s[:1024], 1024)


@pytest.mark.parametrize("width, block, match", [(96, 48, "power of two"), (96, 64, "not a multiple")])
def test_fwht_errors(width, block, match):
    with pytest.raises(ValueError, match=match):
        fwht(torch.zeros(1, width), block)
