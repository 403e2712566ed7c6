"""Public kernels the ternary layers are measured against (issue 19), fed the same codes as ours.

gemlite 0.6 (PyPI `gemlite`, Triton low-bit GEMV/GEMM; optional: `pip install gemlite==0.6.0.post2`) takes HQQ's
form, W ≈ (W_q - zero) · scale per group; our checkpoint's codes u = w + 1 in {0, 1, 2} (ternary.format) with
their group-128 scales are exactly that form with zero = 1, so no re-quantization stands between the two.
Kept apart from benchmarks.kernels so that its conversion is tested on CPU without importing any kernel."""

from __future__ import annotations

import torch

from bonsai_vllm.ternary.format import unpack_ternary


def hqq_form(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Our codes (int32 [N, K/16]) and scales (fp16 [N, K/128]) as (W_q uint8 [N, K] = u, scales, zero = 1)."""
    return (unpack_ternary(packed) + 1).to(torch.uint8), scales, 1


def gemlite_version() -> str | None:
    try:
        import gemlite
    except ImportError:
        return None
    return gemlite.__version__


def gemlite_layer(packed: torch.Tensor, scales: torch.Tensor):
    """A gemlite 2-bit group-128 layer over our codes, bf16 in and out (CUDA; gemlite installed: see
    gemlite_version)."""
    import gemlite

    n, k = packed.shape[0], packed.shape[1] * 16
    w_q, s, zero = hqq_form(packed, scales)
    layer = gemlite.GemLiteLinear(2, group_size=128, in_features=k, out_features=n,
                                  input_dtype=gemlite.DType.BF16, output_dtype=gemlite.DType.BF16)
    layer.pack(w_q, s.to(torch.bfloat16), zero)
    return layer
