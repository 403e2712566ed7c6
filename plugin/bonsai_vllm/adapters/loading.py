"""Let vLLM's Qwen3.5 loader accept checkpoints whose GDN input projection is already fused.

vLLM 0.32 maps Qwen3.5's separate `in_proj_qkv` / `in_proj_z` tensors onto its fused `in_proj_qkvz`
parameter by *substring*: the rule ".in_proj_qkv" → ".in_proj_qkvz" also fires on a name that is already
`...in_proj_qkvz.weight` and turns it into `in_proj_qkvzz`, so a checkpoint stored with vLLM's fused names
(the published prism_ternary one) cannot load. Anchoring every stacked rule at the end of a name
component (".in_proj_qkv." → ".in_proj_qkvz.") keeps the mapping identical for split checkpoints and lets
fused tensors through with no shard id, which vLLM's loaders split by output sizes ("fused on disk").
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.bonsai")


def anchor_stacked_rules(mapper):
    """A copy of a WeightsMapper whose stacked substring rules match whole name components only."""
    from dataclasses import replace

    anchored = {}
    for old, (new, shard) in mapper.orig_to_new_stacked.items():
        if old.endswith("."):
            anchored[old] = (new, shard)
        else:
            anchored[old + "."] = (new + ".", shard)
    return replace(mapper, orig_to_new_stacked=anchored)


def patch_qwen3_5_loader() -> None:
    from vllm.model_executor.models import qwen3_5

    model_cls = qwen3_5.Qwen3_5Model
    if getattr(model_cls, "_bonsai_anchored", False):
        return
    model_cls.hf_to_vllm_mapper = anchor_stacked_rules(model_cls.hf_to_vllm_mapper)
    model_cls._bonsai_anchored = True
    logger.debug("anchored Qwen3_5Model stacked weight-name rules")
