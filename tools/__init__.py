"""Developer checks of the kernels, run from the repository root; not part of the served package.

    compile_check.py  make compile-check: every Triton kernel compiled for sm_90 and sm_120 (no GPU needed)
    gpu_check.py      make gpu-check: every kernel the served path launches, at real shapes, vs the references
"""
