"""The int8 all-reduce (comm.reference) against the exact sum, on random and outlier-heavy payloads."""

from __future__ import annotations

import pytest
import torch

from bonsai_vllm.comm.reference import dequantize_int8, error_bound, int8_all_reduce, pack, quantize_int8


def all_reduce_over(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run int8_all_reduce as each rank would, with the gather answered from `parts`."""
    packed = torch.stack([pack(p) for p in parts])  # what an all-gather of every rank's pack returns
    return [int8_all_reduce(p, lambda buf: packed) for p in parts]


def payloads(kind: str, world: int = 2, rows: int = 512, n: int = 5120) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(hash(kind) % 2**31)
    parts = [torch.randn(rows, n, generator=gen) for _ in range(world)]
    if kind == "outliers":
        # A few huge activations per row (the massive-activation channels of LLM residual streams).
        for p in parts:
            idx = torch.randint(0, n, (rows, 4), generator=gen)
            p.scatter_(1, idx, 300.0 * torch.randn(rows, 4, generator=gen))
    return parts


def test_quantize_round_trip_within_half_a_step():
    x = torch.randn(16, 1024)
    q, s = quantize_int8(x)
    err = (dequantize_int8(q, s) - x).abs()
    step = s.repeat_interleave(128, dim=-1)
    assert (err <= step / 2 + 1e-6).all()
    assert q.dtype == torch.int8 and q.abs().max() == 127


@pytest.mark.parametrize("kind", ["random", "outliers"])
def test_error_bounded_and_stated(kind):
    parts = payloads(kind)
    exact = torch.stack(parts).sum(0)
    results = all_reduce_over(parts)
    # Every rank ends with the same bits: the ranks' hidden states must not drift apart.
    assert all(torch.equal(results[0], r) for r in results[1:])
    err = (results[0] - exact).abs()
    assert (err <= error_bound(parts)).all()
    rel = (err.norm() / exact.norm()).item()
    print(f"\nint8 all-reduce, {kind}: relative error {rel:.2e}, max abs {err.max():.3g}")
    # Random: ~0.5% (uniform rounding of absmax/127 steps). Outliers inflate their groups' steps.
    assert rel < (1e-2 if kind == "random" else 5e-2)


def test_a_broken_scale_is_caught():
    parts = payloads("random")
    exact = torch.stack(parts).sum(0)
    packed = torch.stack([pack(p) for p in parts])
    n_codes = parts[0].numel()
    packed[1, n_codes:] = torch.zeros_like(packed[1, n_codes:])  # rank 1's scales lost in transit
    wrong = int8_all_reduce(parts[0], lambda buf: packed)
    assert not (wrong - exact).abs().le(error_bound(parts)).all()


def test_bytes_halved():
    x = torch.randn(512, 5120, dtype=torch.bfloat16)
    assert pack(x).numel() / (x.numel() * x.element_size()) < 0.52
