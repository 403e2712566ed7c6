"""Benchmarks: each prints ratios measured side by side in one run; docs/benchmarks.md records them.

    harness.py  CUDA timing shared by the GPU benchmarks (CUDA-graph replays over L2-missing weight copies)
    kernels.py  make bench-kernels: ternary linear, Hadamard, int8 all-reduce vs bf16 cuBLAS and the byte floor
    decode.py   make bench-decode: decode GEMV candidates at M = 1 … 16
    kv.py       make bench-kv: K3V2 store / decode / prefill kernels
    gemv_variants.py  the multi-row GEMV `rows` that decode.py times and the served dispatch never launches
                (the package's kernel files hold only what it does)
    priority.py make bench-priority: chat TTFT behind agents, scheduler on vs off (vLLM-CPU)
    gateway.py  make bench-proxy: the gateway's overhead, direct vs through nginx

Run from the repository root (`python -m benchmarks.kernels`, with the plugin importable). Not in any image.
"""
