"""Ternary linear layers: the prism_ternary checkpoint format, its reference maths, the TP=2 split, kernels.

    format.py     2-bit code packing, sign vectors, quantization_config (shared with model-fetch)
    reference.py  the float32 judge: Hadamard rotation, ternary linear, the exact int8 decomposition
    quantize.py   dense -> ternary (bonsai-convert, tiny models) and back
    partition.py  which Hadamard blocks each TP rank owns, and the half-block exchange at TP=2
    kernels/      Triton: GEMV for decode rows, int8 GEMM for prefill, fused rotation; linear.py dispatches

vLLM-free: imports torch, numpy and (in kernels/, lazily) Triton, never vLLM.
"""
