"""bonsai_vllm: serve Ternary-Bonsai-2-27B with vLLM 0.32.

One folder per domain, each with its PyTorch reference beside its Triton kernels; none of them imports vLLM
(the lent GPU has none, and model-fetch reuses the format and checkpoint code):

    ternary/     the prism_ternary format, reference maths, TP=2 split, linear kernels
    kv/          the K3V2 KV cache: format, rotation, reference, paged layout, kernels, capacity
    comm/        the int8 all-reduce
    checkpoint/  bonsai-convert and the official-pack converter
    embeddings.py  the embedding table on SSD (export format and hot/cold lookup)
    scheduling.py  the priority-preemption policy
    settings.py    every BONSAI_* switch: default, type, help
    serve.py       bonsai-serve: the compose vllm service's command line and preflight
    testing/     tiny models and the dev servers the tests and `make demo` use

`adapters/` is the only place that imports vLLM: the thin layer that plugs the above into it (entry point:
`adapters.plugin.register`).
"""

__version__ = "0.1.0"
