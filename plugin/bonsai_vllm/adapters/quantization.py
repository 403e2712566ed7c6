"""`prism_ternary` in vLLM 0.32: the quantization config and the ternary linear method.

The checkpoint format is read by `bonsai_vllm.ternary.format`; the maths is `bonsai_vllm.ternary.reference` (and,
on GPU, the kernels of `bonsai_vllm.ternary.kernels`). This file only plugs them into vLLM's layer classes:

- which modules are ternary (`get_quant_method`): the fused vLLM names of `ternary.format.TERNARY_MODULES`,
  not under the MTP drafter (its `mtp.*` tensors are bf16 in the published checkpoint);
- the parameters each ternary layer owns: `weight` int32 [out, in/16] (16 two-bit codes per word, packed
  along the input) and `scales` fp16 [out, in/128], both sharded by vLLM's own loaders;
- the forward: rotate this rank's input slice (`ternary.partition`, exchanging half blocks at TP=2), then
  multiply by W' — `ternary.kernels.ternary_linear`, which runs the Triton kernels on CUDA and the reference
  maths elsewhere, behind an opaque custom op so torch.compile does not trace into kernel dispatch.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

from bonsai_vllm.ternary import format as fmt
from bonsai_vllm.ternary.kernels.linear import TernaryWeights, prepare, ternary_linear
from bonsai_vllm.ternary.partition import plan_partition, rotate_partition

CODES_PER_WORD = 16  # 2-bit codes in one int32


# Every ternary layer's state as `prepare` made it at load (its tensors, the dp4a configs its shape takes, W8
# if kept), at the index the layer hands the op. A custom op takes tensors and plain values only; the op used
# to rebuild TernaryWeights from the tensors and so lost what prepare had decided: the served path never took
# the dp4a route that the benchmarks and make gpu-check ran (found 2026-12-02, tests/test_linear_adapter.py).
PREPARED: list[TernaryWeights] = []


@torch.library.custom_op("bonsai::ternary_linear", mutates_args=())
def ternary_linear_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, rotated: bool,
                      layer: int) -> torch.Tensor:
    # x [T, in/tp] (rotated or not) -> y [T, out]; dispatch by device and batch size inside. packed and scales
    # are the layer's own (passed so that a compiled graph sees what the op reads), PREPARED[layer] holds them.
    tw = PREPARED[layer]
    if tw.packed.data_ptr() != packed.data_ptr() or tw.scales.data_ptr() != scales.data_ptr():
        raise RuntimeError(f"bonsai::ternary_linear: layer {layer}'s weights moved after loading")
    return ternary_linear(x, tw, rotated=rotated)


@ternary_linear_op.register_fake
def _(x, packed, scales, rotated, layer):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def _is_drafter(prefix: str) -> bool:
    return prefix.startswith("mtp") or ".mtp." in prefix or prefix.startswith("model.mtp")


@register_quantization_config(fmt.QUANT_METHOD)
class PrismTernaryQuantConfig(QuantizationConfig):
    """vLLM's view of config.json's `quantization_config` for prism_ternary checkpoints."""

    def __init__(self, spec: fmt.PrismTernaryConfig):
        super().__init__()
        self.spec = spec

    def __repr__(self) -> str:
        return f"PrismTernaryQuantConfig({self.spec.to_dict() | {'signs': sorted(self.spec.signs)}})"

    def get_name(self) -> str:
        return fmt.QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # Plain PyTorch runs anywhere; the Triton kernels need no tensor cores either.
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # everything is in config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PrismTernaryQuantConfig":
        return cls(fmt.PrismTernaryConfig.from_dict(config))

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        ternary = fmt.is_ternary_module(prefix) and not _is_drafter(prefix)
        if isinstance(layer, ParallelLMHead):
            return PrismTernaryLinearMethod(self.spec, prefix) if ternary else UnquantizedEmbeddingMethod()
        if isinstance(layer, LinearBase):
            return PrismTernaryLinearMethod(self.spec, prefix) if ternary else UnquantizedLinearMethod()
        return None


@register_weight_loader_v2_supported_method
class PrismTernaryLinearMethod(LinearMethodBase):
    """A ternary linear layer: y = H(s ⊙ x) · W'^T, W' = code × group scale."""

    def __init__(self, spec: fmt.PrismTernaryConfig, prefix: str):
        self.spec = spec
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        spec = self.spec
        weight_loader = extra_weight_attrs["weight_loader"]
        out = sum(output_partition_sizes)
        tp_size = get_tensor_model_parallel_world_size() if input_size_per_partition != input_size else 1
        tp_rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
        # Fails here, at model construction, with the module named, rather than at the first forward.
        try:
            plan = plan_partition(input_size, tp_size, tp_rank, spec.hadamard_block)
            signs = spec.sign_vector(input_size)
        except ValueError as e:
            raise ValueError(f"prism_ternary module '{self.prefix}': {e}") from None
        if input_size_per_partition % spec.group_size:
            raise ValueError(f"prism_ternary module '{self.prefix}': per-rank input width "
                             f"{input_size_per_partition} is not a multiple of group_size {spec.group_size}")

        weight = PackedvLLMParameter(
            data=torch.empty(out, input_size_per_partition // CODES_PER_WORD, dtype=torch.int32),
            input_dim=1, output_dim=0, packed_dim=1, packed_factor=CODES_PER_WORD,
            weight_loader=weight_loader)
        scales = GroupQuantScaleParameter(
            data=torch.empty(out, input_size_per_partition // spec.group_size, dtype=torch.float16),
            input_dim=1, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        layer.register_parameter("scales", scales)
        # This rank's slice of the sign vector; not in the checkpoint, so not a parameter.
        start = tp_rank * input_size_per_partition
        layer.register_buffer("signs", signs[start:start + input_size_per_partition].clone(), persistent=False)
        layer.prism_plan = plan
        layer.prism_tp_rank = tp_rank
        layer.prism_full_shape = (output_size, input_size)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        out, width = layer.weight.shape[0], layer.weight.shape[1] * CODES_PER_WORD
        fmt.check_module_tensors(self.prefix, layer.weight.data, layer.scales.data, out,
                                 layer.prism_full_shape[1], self.spec, in_features_per_partition=width)
        # vLLM's parameter subclasses carry loader state that is not needed after loading.
        layer.weight = torch.nn.Parameter(layer.weight.data, requires_grad=False)
        layer.scales = torch.nn.Parameter(layer.scales.data, requires_grad=False)
        layer.signs = layer.signs.to(layer.weight.device)
        assert width == layer.prism_plan.width
        # The per-row int8 decomposition of the scales for the prefill path (N·K/128 bytes, small) and the
        # decode routes this shape takes; kept for the op by index.
        tw = prepare(layer.weight.data, layer.scales.data, layer.signs, block=self.spec.hadamard_block)
        layer.prism_index = len(PREPARED)
        PREPARED.append(tw)

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        return get_tp_group().all_gather(t, dim=-1)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        plan = layer.prism_plan
        if plan.cut:
            # x [T, in/tp] -> this rank's slice of the full rotation (one all-gather of half blocks)
            x = rotate_partition(x, layer.signs, plan, layer.prism_tp_rank, self._exchange)
        y = torch.ops.bonsai.ternary_linear(x, layer.weight, layer.scales, plan.cut, layer.prism_index)
        return y if bias is None else y + bias
