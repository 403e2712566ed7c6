"""Guarded Triton import and the two facts every kernel wrapper needs: can Triton run here, and how.

Importing this never fails: without Triton, `triton` and `tl` are None and `usable()` is False, so the
vLLM-free core (and the reference path of `kernels.linear`) still imports on any machine.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: CPU-only installs keep the PyTorch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (Triton runs kernels on CPU tensors through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def usable(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on this tensor: a CUDA tensor, or any tensor under the interpreter."""
    return triton is not None and (t.is_cuda or interpreting())


def dot_dtype():
    """Operand type of the tensor-core dots: bf16 on the GPU.

    The interpreter (Triton 3.7) stores bf16 as raw uint16 and multiplies the bit patterns in tl.dot, so it
    gets float32 operands instead; every value we feed a dot is exact in bf16, so the maths is the same.
    """
    return tl.float32 if interpreting() else tl.bfloat16


def require() -> None:
    if triton is None:
        raise RuntimeError("bonsai_vllm kernels: Triton is not installed; use the PyTorch reference path "
                           "(bonsai_vllm.ternary.reference, bonsai_vllm.kv.reference) or install triton")
