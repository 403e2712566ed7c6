"""The vLLM-free core: imports torch, numpy and safetensors, never vLLM (nor anything that imports it)."""
