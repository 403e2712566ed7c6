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


def early_launch(t: torch.Tensor) -> bool:
    """Whether a kernel on `t` may let the next kernel start before it ends (PTX `griddepcontrol`, sm_90 and
    later; not under the interpreter): the `EARLY_LAUNCH` constexpr of the kernels that call
    `launch_dependents`."""
    return t.is_cuda and not interpreting() and torch.cuda.get_device_capability(t.device)[0] >= 9


if triton is not None:

    @triton.jit
    def launch_dependents(ON: tl.constexpr):
        """Let the kernel queued after this one start now, if it was launched as a programmatic dependent
        (nvrtc.launch(..., early=True)): it may read what does not depend on this kernel (its weights) until its
        `griddepcontrol.wait`, which waits for this kernel's end and its memory. No effect on ordinary launches."""
        if ON:
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
