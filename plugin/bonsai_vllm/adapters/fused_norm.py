"""The post-attention RMSNorm of Qwen3.5's decoder layers fused into gate_up_proj's activation prep (issue 19;
BONSAI_FUSED_NORM, off by default).

vLLM runs, per decoder layer, `hidden, residual = post_attention_layernorm(hidden, residual)` (a residual add and
GemmaRMSNorm) and then `mlp(hidden)`, whose first step is gate_up_proj. On CUDA our gate_up then rotates and
prepares the normed rows in a kernel of its own before its GEMV: norm, prep and GEMV are three kernels. With the
setting on, `kernels.linear.norm_ternary_linear` does the add, the norm, the rotation and the prep in one kernel
(rotate_prep.norm_rotate_prep), so a decode step crosses one kernel boundary less per layer.

How it is plugged in, without restating vLLM's decoder forward: when a `Qwen3_5DecoderLayer` is built with a dense
MLP whose gate_up_proj is ours, two of its modules change class (their parameters, names and loading stay):
- post_attention_layernorm becomes `NormThenGateUp`: it returns (gate_up's output, the new residual), computed by
  the custom op `bonsai::norm_ternary_linear`;
- mlp becomes `MlpAfterGateUp`: act_fn and down_proj only.
The decoder's own forward then passes gate_up's output where it passed the normed rows. Nothing else reads those
rows (gate_up is the MLP's only input), which is what makes the fusion exact.
"""

from __future__ import annotations

import logging

import torch

from bonsai_vllm import settings
from bonsai_vllm.ternary.kernels.linear import norm_ternary_linear

logger = logging.getLogger("vllm.bonsai")

GEMMA_OFFSET = 1.0  # vLLM's GemmaRMSNorm multiplies by weight.float() + 1.0


@torch.library.custom_op("bonsai::norm_ternary_linear", mutates_args=())
def norm_ternary_linear_op(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           weight_offset: float, packed: torch.Tensor, scales: torch.Tensor,
                           layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual [T, K] -> (y [T, N], new residual [T, K]); the layer's state by index, as bonsai::ternary_linear
    from bonsai_vllm.adapters.quantization import PREPARED

    tw = PREPARED[layer]
    if tw.packed.data_ptr() != packed.data_ptr() or tw.scales.data_ptr() != scales.data_ptr():
        raise RuntimeError(f"bonsai::norm_ternary_linear: layer {layer}'s weights moved after loading")
    return norm_ternary_linear(x, residual, norm_weight, eps, tw, weight_offset=weight_offset)


@norm_ternary_linear_op.register_fake
def _(x, residual, norm_weight, eps, weight_offset, packed, scales, layer):
    return x.new_empty((*x.shape[:-1], packed.shape[0])), torch.empty_like(residual)


def _gemma_norm_class():
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    class NormThenGateUp(GemmaRMSNorm):
        """post_attention_layernorm and gate_up_proj in one: (x, residual) -> (gate_up's output, new residual)."""

        def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
            (gate_up,) = self.bonsai_gate_up  # a tuple, so that the module is not registered twice
            if residual is None:  # not how the decoder calls it; kept whole for any other caller
                y, _ = gate_up(super().forward(x))
                return y
            return torch.ops.bonsai.norm_ternary_linear(x, residual, self.weight, self.variance_epsilon,
                                                        GEMMA_OFFSET, gate_up.weight, gate_up.scales,
                                                        gate_up.prism_index)

    return NormThenGateUp


def _mlp_class():
    from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP

    class MlpAfterGateUp(Qwen2MoeMLP):
        """The dense MLP from gate_up's output on: act_fn, then down_proj."""

        def forward(self, gate_up_out: torch.Tensor) -> torch.Tensor:
            out, _ = self.down_proj(self.act_fn(gate_up_out))
            return out

    return MlpAfterGateUp


_CLASSES: dict[str, type] = {}


def fuse_decoder_layer(layer: torch.nn.Module) -> bool:
    """Swap `layer`'s post_attention_layernorm and mlp for the fused pair where it qualifies (a dense SiLU MLP
    whose gate_up_proj is a ternary layer taking its whole input, a GemmaRMSNorm ahead of it, no layer scale or
    sequence-parallel MoE); whether it did."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm
    from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP

    from bonsai_vllm.adapters.quantization import PrismTernaryLinearMethod

    mlp, norm = getattr(layer, "mlp", None), getattr(layer, "post_attention_layernorm", None)
    if type(mlp) is not Qwen2MoeMLP or type(norm) is not GemmaRMSNorm or mlp.expert_gate is not None:
        return False
    if getattr(layer, "layer_scale", False) or getattr(layer, "use_attn_reduce_scatter_for_moe", False):
        return False
    gate_up = mlp.gate_up_proj
    if not isinstance(gate_up.quant_method, PrismTernaryLinearMethod) or gate_up.prism_plan.cut:
        return False
    if not _CLASSES:
        _CLASSES["norm"], _CLASSES["mlp"] = _gemma_norm_class(), _mlp_class()
    norm.__class__ = _CLASSES["norm"]
    norm.bonsai_gate_up = (gate_up,)
    mlp.__class__ = _CLASSES["mlp"]
    return True


def install_fused_norm() -> None:
    """Make every Qwen3_5DecoderLayer built from now on fuse its post-attention norm where BONSAI_FUSED_NORM is
    on (read when the layer is built, in the worker)."""
    from vllm.model_executor.models.qwen3_5 import Qwen3_5DecoderLayer

    if getattr(Qwen3_5DecoderLayer.__init__, "bonsai_fused_norm", False):
        return
    original = Qwen3_5DecoderLayer.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if settings.get("BONSAI_FUSED_NORM") and fuse_decoder_layer(self):
            level = logging.INFO if self.layer_idx == 0 else logging.DEBUG
            logger.log(level, "layer %d: post_attention_layernorm fused into gate_up_proj's prep "
                       "(BONSAI_FUSED_NORM)", self.layer_idx)

    __init__.bonsai_fused_norm = True
    Qwen3_5DecoderLayer.__init__ = __init__
