"""The CPU model of tensor-core accumulation (tensor_cores.py) against what the H200 did (2026-12-01): fp16
products of r ulp of a float32 accumulator holding 1.0, 16 per k-step, added 1000 times."""

from __future__ import annotations

import numpy as np
import pytest

from tensor_cores import accumulate

# r (each product, in ulps of the accumulator) -> ulps the H200 added per step of 16 products
H200 = {1 / 64: 0.0, 3 / 32: 0.0, 3 / 16: 0.0, 1 / 4: 4.0, 3 / 8: 4.0, 1 / 2: 8.0, 3 / 4: 12.0, 1.0: 16.0,
        3 / 2: 24.0}


@pytest.mark.parametrize("r", sorted(H200))
def test_model_reproduces_the_h200_probe(r):
    a = np.full((16, 16), 2.0 ** -14, np.float16)
    b = np.full((16, 16), r * 2.0 ** -9, np.float16)  # each product r · 2^-23 = r ulp of 1.0
    acc = np.ones((16, 16), np.float32)
    for _ in range(50):
        acc = accumulate(a, b, acc)
    assert (acc - 1.0) / 2.0 ** -23 / 50 == pytest.approx(H200[r])


def test_model_is_exact_where_nothing_is_cut():
    rng = np.random.default_rng(0)
    a = rng.integers(-8, 8, (4, 64)).astype(np.float16)
    b = rng.integers(-8, 8, (64, 4)).astype(np.float16)
    assert np.array_equal(accumulate(a, b, np.zeros((4, 4), np.float32)), (a.astype(np.float32) @ b.astype(np.float32)))
