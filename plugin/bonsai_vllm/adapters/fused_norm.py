"""Qwen3.5's RMSNorms fused into the activation prep of the ternary layer each one feeds (issue 19;
BONSAI_FUSED_NORM, on by default).

vLLM runs, per decoder layer, `hidden, residual = post_attention_layernorm(hidden, residual)` (a residual add and
GemmaRMSNorm) and then `mlp(hidden)`, whose first step is gate_up_proj; a full-attention layer likewise starts with
input_layernorm and then self_attn's qkv_proj. On CUDA our layer then rotates and prepares the normed rows in a
kernel of its own before its GEMV: norm, prep and GEMV are three kernels. With the setting on,
`kernels.linear.norm_ternary_linear` does the add, the norm, the rotation and the prep in one kernel
(rotate_prep.norm_rotate_prep), so a decode step crosses one kernel boundary less per fused pair: 64 gate_up and
16 qkv per rank for the 27B. (The Gated DeltaNet layers' input norm also feeds the bf16 in_proj_ba, so it stays.)

How it is plugged in, without restating vLLM's forwards: when a `Qwen3_5DecoderLayer` is built, each qualifying
(norm, layer) pair changes class (parameters, names and loading stay):
- the norm becomes `NormThenLayer`: it returns (the layer's output, the new residual), computed by the custom op
  `bonsai::norm_ternary_linear`;
- the layer becomes a pass-through of its own class: it returns its input, which is now already its output.
vLLM's decoder, attention and MLP forwards then run unchanged. The normed rows feed nothing but that layer (the
attention's and the MLP's only use of their input), which is what makes the fusion exact.
"""

from __future__ import annotations

import logging

import torch

from bonsai_vllm import settings
from bonsai_vllm.ternary.kernels.linear import norm_ternary_linear

logger = logging.getLogger("vllm.bonsai")

GEMMA_OFFSET = 1.0  # vLLM's GemmaRMSNorm multiplies by weight.float() + 1.0


@torch.library.custom_op("bonsai::norm_ternary_linear", mutates_args=())
def norm_ternary_linear_op(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                           weight_offset: float, packed: torch.Tensor, scales: torch.Tensor,
                           layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual [T, K] -> (y [T, N], new residual [T, K]; [0] without a residual); the layer's state by index,
    # as bonsai::ternary_linear
    from bonsai_vllm.adapters.quantization import PREPARED

    tw = PREPARED[layer]
    if tw.packed.data_ptr() != packed.data_ptr() or tw.scales.data_ptr() != scales.data_ptr():
        raise RuntimeError(f"bonsai::norm_ternary_linear: layer {layer}'s weights moved after loading")
    y, new_residual = norm_ternary_linear(x, residual, norm_weight, eps, tw, weight_offset=weight_offset)
    return y, x.new_empty(0) if new_residual is None else new_residual


@norm_ternary_linear_op.register_fake
def _(x, residual, norm_weight, eps, weight_offset, packed, scales, layer):
    return x.new_empty((*x.shape[:-1], packed.shape[0])), x.new_empty(0) if residual is None else torch.empty_like(x)


_CLASSES: dict[type, type] = {}  # vLLM's class -> ours


def _norm_class() -> type:
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    class NormThenLayer(GemmaRMSNorm):
        """A GemmaRMSNorm and the ternary layer after it in one: (x, residual) -> (the layer's output, the new
        residual); x -> the layer's output without a residual (vLLM's first decoder layer)."""

        def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
            (layer,) = self.bonsai_layer  # a tuple, so that the module is not registered twice
            y, new_residual = torch.ops.bonsai.norm_ternary_linear(x, residual, self.weight, self.variance_epsilon,
                                                                   GEMMA_OFFSET, layer.weight, layer.scales,
                                                                   layer.prism_index)
            return y if residual is None else (y, new_residual)

    return NormThenLayer


def _passthrough_class(cls: type) -> type:
    def forward(self, x: torch.Tensor):
        return x, None  # x is this layer's output already (NormThenLayer); vLLM's linears return (y, bias)

    return type(f"Normed{cls.__name__}", (cls,), {
        "forward": forward, "__doc__": f"{cls.__name__} whose norm ahead computed it (adapters/fused_norm.py)."})


def fuse(norm: torch.nn.Module, layer: torch.nn.Module) -> bool:
    """Make `norm` (a GemmaRMSNorm) compute `layer` (a ternary layer taking its whole input, unrotated) and
    `layer` pass its input through; whether the pair qualified."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    from bonsai_vllm.adapters.quantization import PrismTernaryLinearMethod

    if type(norm) is not GemmaRMSNorm or not isinstance(getattr(layer, "quant_method", None),
                                                        PrismTernaryLinearMethod):
        return False
    if layer.prism_plan.cut or getattr(layer, "bias", None) is not None:
        return False
    if GemmaRMSNorm not in _CLASSES:
        _CLASSES[GemmaRMSNorm] = _norm_class()
    if type(layer) not in _CLASSES:
        _CLASSES[type(layer)] = _passthrough_class(type(layer))
    norm.__class__ = _CLASSES[GemmaRMSNorm]
    norm.bonsai_layer = (layer,)
    layer.__class__ = _CLASSES[type(layer)]
    return True


def fuse_decoder_layer(layer: torch.nn.Module) -> list[str]:
    """Fuse what qualifies in one decoder layer: post_attention_layernorm into a dense SiLU MLP's gate_up_proj, and
    a full-attention layer's input_layernorm into qkv_proj (not where a layer scale or sequence-parallel MoE comes
    between). The names of the layers fused."""
    from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP

    if getattr(layer, "layer_scale", False) or getattr(layer, "use_attn_reduce_scatter_for_moe", False):
        return []
    done = []
    mlp = getattr(layer, "mlp", None)
    if type(mlp) is Qwen2MoeMLP and mlp.expert_gate is None and fuse(layer.post_attention_layernorm, mlp.gate_up_proj):
        done.append("gate_up_proj")
    attn = getattr(layer, "self_attn", None)
    if layer.layer_type == "full_attention" and attn is not None and fuse(layer.input_layernorm, attn.qkv_proj):
        done.append("qkv_proj")
    return done


def install_fused_norm() -> None:
    """Make every Qwen3_5DecoderLayer built from now on fuse its norms where BONSAI_FUSED_NORM is on (read when
    the layer is built, in the worker)."""
    from vllm.model_executor.models.qwen3_5 import Qwen3_5DecoderLayer

    if getattr(Qwen3_5DecoderLayer.__init__, "bonsai_fused_norm", False):
        return
    original = Qwen3_5DecoderLayer.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if settings.get("BONSAI_FUSED_NORM"):
            done = fuse_decoder_layer(self)
            if done:
                level = logging.INFO if self.layer_idx < 4 else logging.DEBUG
                logger.log(level, "layer %d: RMSNorm fused into the prep of %s (BONSAI_FUSED_NORM)", self.layer_idx,
                           " and ".join(done))

    __init__.bonsai_fused_norm = True
    Qwen3_5DecoderLayer.__init__ = __init__
