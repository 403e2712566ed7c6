"""Triton's interpreter for the kernel test modules on CPU, without leaking it into later tests.

Kernel test modules switch TRITON_INTERPRET=1 on before importing their kernels (@triton.jit decorates them
as interpreted functions then), and keep it on while their tests run (the dispatchers read it per call).
Both modules are imported at collection, before any test runs, so the value to restore afterwards is the
one from before the first of them: it is read once, when this helper is first imported. Restoring to what
each module saw instead put "1" back for the rest of the session whenever two kernel modules were
collected, and every later vLLM server inherited it: the ternary model's CPU forward then ran the
interpreted kernels at full size and start-up hung (CI, 2026-11-29).
"""

from __future__ import annotations

import os
import sys

ORIGINAL_INTERPRET: str | None = os.environ.get("TRITON_INTERPRET")


def enable() -> None:
    """Turn the interpreter on (before the kernel modules' import, and again as each module's tests start)."""
    os.environ["TRITON_INTERPRET"] = "1"


def restore(modules: list[str]) -> None:
    """Put TRITON_INTERPRET back as the session had it; forget `modules` (full names) and their attributes
    on the parent package, so that a later import decorates those kernels anew."""
    if ORIGINAL_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = ORIGINAL_INTERPRET
    for name in modules:
        sys.modules.pop(name, None)
        parent, _, attr = name.rpartition(".")
        if parent in sys.modules:
            sys.modules[parent].__dict__.pop(attr, None)


def module_fixture(modules: list[str]):
    """The autouse module fixture of a kernel test module on CPU: interpreter on while its tests run (another
    module's teardown may have reset it), then the session's value back and `modules` forgotten. On a GPU
    it does nothing. Assign it to a module-level name: `_interpreter = interpreter_scope.module_fixture([...])`."""
    import pytest
    import torch

    @pytest.fixture(scope="module", autouse=True)
    def _interpreter_scope():
        cpu = not torch.cuda.is_available()
        if cpu:
            enable()
        yield
        if cpu:
            restore(modules)

    return _interpreter_scope
