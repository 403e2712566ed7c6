"""Triton kernels of the K3V2 KV cache, each judged by `bonsai_vllm.kv.reference`.

    store.py   quantize + pack + scatter new tokens into their pages      ~ reference.store_ref
    decode.py  grouped split-KV decode over the pages, LSE merge with the bf16 part  ~ reference.decode_ref

Imported lazily by their callers: they define @triton.jit functions at import.
"""
