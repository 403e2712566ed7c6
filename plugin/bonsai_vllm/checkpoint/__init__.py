"""Checkpoints on disk: writing and converting the prism_ternary vLLM checkpoint.

    convert.py   bonsai-convert: dense Hugging Face Qwen3.5 <-> prism_ternary (vLLM names)
    official.py  the published MLX 2-bit pack -> the same prism_ternary checkpoint

Shared by model-fetch (the init container) and the tests' tiny models; vLLM-free.
"""
