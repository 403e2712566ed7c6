"""Undo what a kernel test module did to run Triton's interpreter on CPU, so later tests see a clean state.

Kernel test modules set TRITON_INTERPRET=1 before importing their kernels; @triton.jit then decorates the
kernels as interpreted functions. Afterwards the variable must not leak into later tests (or the vLLM
servers they start), and those kernel modules must be imported anew by whoever needs them next.
"""

from __future__ import annotations

import os
import sys


def restore(previous_interpret: str | None, modules: list[str]) -> None:
    """Put TRITON_INTERPRET back and forget `modules` (full names) and their attributes on the parent."""
    if previous_interpret is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = previous_interpret
    for name in modules:
        sys.modules.pop(name, None)
        parent, _, attr = name.rpartition(".")
        if parent in sys.modules:
            sys.modules[parent].__dict__.pop(attr, None)
