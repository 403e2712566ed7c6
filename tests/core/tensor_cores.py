"""A CPU model of how NVIDIA tensor cores accumulate a 16-bit dot in float32, for Triton's interpreter.

The interpreter computes `tl.dot(a, b, acc)` with numpy in float32, rounding to nearest: much more exactly
than the GPU. Measured on the H200 (2026-12-01, `tl.dot` of fp16 tiles into a float32 accumulator holding
1.0, 1000 steps; docs/dev-notes.md): every product smaller than 2^-2 ulp of the accumulator is dropped,
and larger ones are truncated toward zero to multiples of 2^-2 ulp — 0.375 ulp per product added 0.25, for
K = 16, 32 and 128 and tiles of 16 and 64 rows alike. That is the behaviour described for Volta to Hopper
(Fasi et al., "Numerical behavior of NVIDIA tensor cores", 2021): the products of one k-step and the
accumulator are aligned to the largest exponent among them, the bits beyond a fixed width are cut off, the
aligned terms are summed, and the sum is truncated to float32.

`truncating_dots()` swaps the interpreter's dot for that model while a test runs: for each k-step of 16,
products computed exactly (float64), every term (the accumulator too) truncated toward zero to a multiple
of 2^(e - 25) where 2^e is the largest term's leading power of two, summed exactly, truncated to float32.
Only 16-bit floating inputs with a float32 accumulator take the model (the tensor-core case); other dots
(int8, float32 operands) keep the interpreter's own.

A kernel that leaves a large, nearly constant offset in its accumulator over thousands of steps loses
its small contributions this way on the GPU; CPU tests of such kernels see the loss only through this model.
"""

from __future__ import annotations

import contextlib

import numpy as np

K_STEP = 16  # products summed per alignment (one fp16 MMA k-step)
EXTRA_BITS = 2  # bits kept below the float32 ulp of the largest term (the H200 probe)


def _trunc_to_f32(s: np.ndarray) -> np.ndarray:
    """float64 -> float32, rounded toward zero."""
    r = s.astype(np.float32)
    over = np.abs(r.astype(np.float64)) > np.abs(s)
    r[over] = np.nextafter(r[over], np.float32(0))
    return r


def accumulate(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc [M, N] float32 + a [M, K] · b [K, N] (16-bit floats) as the tensor cores sum it."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    acc = acc.astype(np.float32)
    for k0 in range(0, a64.shape[1], K_STEP):
        prods = a64[:, k0:k0 + K_STEP, None] * b64[None, k0:k0 + K_STEP, :]  # [M, k, N], exact
        top = np.maximum(np.abs(acc).astype(np.float64), np.abs(prods).max(axis=1))  # [M, N]
        with np.errstate(divide="ignore"):
            e = np.floor(np.log2(np.where(top > 0, top, 1.0)))
        quantum = np.exp2(e - 23 - EXTRA_BITS)  # [M, N]
        cut = np.trunc(prods / quantum[:, None, :]) * quantum[:, None, :]
        acc_cut = np.trunc(acc.astype(np.float64) / quantum) * quantum
        acc = _trunc_to_f32(acc_cut + cut.sum(axis=1))
    return acc


@contextlib.contextmanager
def truncating_dots():
    """Inside: the interpreter's tl.dot on fp16/bf16 operands with a float32 accumulator follows the model."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        sixteen = all(x.dtype.primitive_bitwidth == 16 and x.dtype.is_floating() for x in (a, b))
        if not sixteen or d.data.dtype != np.float32:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = a.data, b.data
        if a.dtype.is_bf16():  # the interpreter keeps bf16 as its raw uint16 bits
            a_data = (a_data.astype(np.uint32) << 16).view(np.float32)
            b_data = (b_data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(accumulate(a_data, b_data, d.data), d.dtype.scalar)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original
