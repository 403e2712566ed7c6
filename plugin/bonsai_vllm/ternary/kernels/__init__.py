"""Triton kernels (and two CUDA C kernels, stream_gemv.cu and mma.cu) for the hot paths of a prism_ternary layer on NVIDIA GPUs
(H200 sm_90, RTX 50 sm_120).

The PyTorch reference in `ternary.reference` / `ternary.reference` stays the judge: every kernel here sits beside
the reference function it must match (tests/core/test_kernels.py, and on a GPU `python -m
benchmarks.kernels`, which checks before it times). Triton is imported lazily and guardedly:
this package imports where Triton is missing or has no GPU backend, and then everything falls back to the
reference.

API for the vLLM adapter
------------------------
Layer state, once at load (`process_weights_after_loading`)::

    from bonsai_vllm.ternary.kernels import prepare, ternary_linear
    layer.prism = prepare(layer.weight, layer.scales, layer.signs, expand_int8=False)
        # packed int32 [N, K/16], scales fp16 [N, K/128], signs float32 [K] (this rank's slice, or None)
        # expand_int8=True keeps W8 int8 [N, K] for prefill (N·K bytes; TernaryWeights.int8_bytes())

Forward (`apply`)::

    y = ternary_linear(x, layer.prism, bias=bias)             # x [..., K] unrotated, K % 1024 == 0
    y = ternary_linear(xr, layer.prism, rotated=True)         # xr = ternary.partition.rotate_partition(...)

    M <= 2 rows, CUDA    -> rotation + dp4a prep, the streaming GEMV (stream_gemv.py / .cu, NVRTC; 4 rows too
                            on the narrow layers)
    M = 1 otherwise      -> the same prep, the dp4a GEMV (dp4a.py)
    M <= 64 rows, CUDA   -> the same prep, the int8 tensor-core kernel on the codes (mma.py / mma.cu, NVRTC)
    M <= GEMV_MAX_M rows -> block_hadamard + ternary_gemv (codes read once, decoded in registers)
    larger M             -> quantize_per_token (rotation fused) + int8 matmul (int_mm + rescale, or int8_gemm);
                            W8 not kept: codes_gemm, which decodes W8 in its K loop, up to 512 rows
                            (BONSAI_CODES_GEMM, on), expand_int8 per call first beyond
    CPU / no Triton      -> the reference maths (float32)
    (linear.py's docstring has the exact rule and the switches)

Building blocks (all take `out=` so callers and tests can pass preallocated / poisoned buffers):

- `block_hadamard(x, signs, block=1024)`: H(s ⊙ x) per block (256/512/1024) -> x's dtype.
- `quantize_per_token(x, signs=None)`: (int8 [M, K], float32 scale [M]); rotates first when given signs.
- `ternary_gemv(xr, packed, scales, bias=None)`: decode GEMV on rotated input.
- `expand_int8(packed, q)`, `int8_gemm(...)`, `int_mm_linear(...)`, `rescale(...)`, `codes_gemm(...)`: the
  prefill pieces.

The int8 all-reduce's kernels are `bonsai_vllm.comm.kernels`.
"""

from __future__ import annotations

from bonsai_vllm.triton_runtime import interpreting, usable
from bonsai_vllm.ternary.kernels.linear import GEMV_MAX_M, TernaryWeights, prepare, ternary_linear

__all__ = ["GEMV_MAX_M", "TernaryWeights", "prepare", "ternary_linear", "interpreting", "usable",
           "block_hadamard", "quantize_per_token", "ternary_gemv", "expand_int8", "int8_gemm", "int_mm_linear",
           "rescale", "codes_gemm"]

_LAZY = {
    "block_hadamard": "hadamard", "quantize_per_token": "hadamard", "ternary_gemv": "gemv",
    "expand_int8": "int8mm", "int8_gemm": "int8mm", "int_mm_linear": "int8mm", "rescale": "int8mm",
    "codes_gemm": "int8mm",
}


def __getattr__(name: str):
    # The kernel modules define @triton.jit functions at import: load them only when asked for.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"bonsai_vllm.ternary.kernels.{_LAZY[name]}"), name)
    raise AttributeError(name)
