"""Thin adapters that plug the vLLM-free domains (ternary, kv, comm, embeddings, scheduling) into vLLM 0.32.

Everything that imports vLLM lives here and nowhere else, so the core stays importable on machines without
vLLM (the lent GPU, the model-fetch container).
"""
