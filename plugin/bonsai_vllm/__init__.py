"""bonsai_vllm: serve Ternary-Bonsai-2-27B with vLLM 0.32.

- `bonsai_vllm.core`: vLLM-free code (checkpoint format, reference maths, kernels, tools).
- `bonsai_vllm.adapters`: the thin layer that plugs the core into vLLM (entry point: `adapters.plugin`).
"""

__version__ = "0.1.0"
