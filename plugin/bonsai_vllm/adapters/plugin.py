"""Entry point of the `vllm.general_plugins` group: vLLM calls `register()` in every process it starts.

vLLM runs general plugins in the API server, the engine core and each worker, possibly more than once per
process, so `register()` must be idempotent and cheap.
"""

from __future__ import annotations

import logging
import os

# A child of vLLM's logger, so our lines appear in the server log with vLLM's format and level.
logger = logging.getLogger("vllm.bonsai")

_registered = False


def register() -> None:
    """Register everything the plugin adds to vLLM (once per process)."""
    global _registered
    if _registered:
        return
    _registered = True
    # Importing the module registers `prism_ternary` with vLLM's quantization registry.
    from bonsai_vllm.adapters import quantization  # noqa: F401
    from bonsai_vllm.adapters.allreduce import patch_tp_all_reduce
    from bonsai_vllm.adapters.embedding import install_ssd_embedding
    from bonsai_vllm.adapters.fused_norm import install_fused_norm
    from bonsai_vllm.adapters.loading import patch_qwen3_5_loader

    patch_qwen3_5_loader()
    install_fused_norm()  # the layers it changes are chosen when built, by BONSAI_FUSED_NORM (on by default)
    patch_tp_all_reduce()
    install_ssd_embedding()  # off unless BONSAI_SSD_EMBED_DIR is set; raises at start-up on a bad export
    register_k3v2_backend()
    logger.info("bonsai_vllm plugin loaded (pid %d)", os.getpid())


def register_k3v2_backend() -> None:
    """Name the K3V2 attention backend in vLLM's registry (vLLM's own hook). Only the registry is imported
    here; the backend module loads when a patched platform selects it for --kv-cache-dtype k3v2."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if "BONSAI_K3V2" not in AttentionBackendEnum.__members__:
        register_backend("BONSAI_K3V2", "bonsai_vllm.adapters.k3v2_attention.K3V2AttentionBackend")
