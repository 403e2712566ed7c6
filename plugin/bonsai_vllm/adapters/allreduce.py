"""Hook the int8 all-reduce (`comm.kernels.tp_all_reduce`) into vLLM's tensor-parallel group.

Every row-parallel layer's all-reduce ends in `GroupCoordinator._all_reduce_out_place` — on GPU through
the `vllm::all_reduce` custom op, on CPU directly — whatever name the caller imported
(`tensor_model_parallel_all_reduce`), so that is where we wrap. For the TP group, payloads of at least
`BONSAI_AR_INT8_MIN_TOKENS` rows go through `bonsai::int8_all_reduce`, an opaque custom op (so
torch.compile does not trace the size test into the graph); smaller ones keep vLLM's own all-reduce. The
op's body is the core's `tp_all_reduce`: Triton pack / unpack on CUDA, the PyTorch reference on CPU.

Switches (environment, read once per process):
- `BONSAI_AR_INT8=0` turns it off (default on, as report 002's `PRISM_AR_INT8=1`; docs/field-reports.md);
- `BONSAI_AR_INT8_MIN_TOKENS` (default 128): rows from which a payload counts as prefill-sized.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from bonsai_vllm import settings
from bonsai_vllm.comm.kernels import tp_all_reduce

logger = logging.getLogger("vllm.bonsai")


def enabled() -> bool:
    return settings.get("BONSAI_AR_INT8")


def min_tokens() -> int:
    return settings.get("BONSAI_AR_INT8_MIN_TOKENS")


def _group(group_name: str):
    from vllm.distributed import parallel_state

    group = parallel_state._groups[group_name]()
    if group is None:
        raise ValueError(f"process group {group_name} is destroyed")
    return group


@torch.library.custom_op("bonsai::int8_all_reduce", mutates_args=())
def int8_all_reduce_op(x: torch.Tensor, group_name: str, min_rows: int) -> torch.Tensor:
    group = _group(group_name)

    def gather(buf: torch.Tensor) -> torch.Tensor:  # [bytes] -> [world, bytes]
        out = torch.empty(group.world_size * buf.numel(), dtype=buf.dtype, device=buf.device)
        dist.all_gather_into_tensor(out, buf, group=group.device_group)
        return out.view(group.world_size, -1)

    return tp_all_reduce(x, gather, group.device_communicator.all_reduce, min_rows)


@int8_all_reduce_op.register_fake
def _(x: torch.Tensor, group_name: str, min_rows: int) -> torch.Tensor:
    return torch.empty_like(x)


def patch_tp_all_reduce() -> None:
    """Route the TP group's all-reduce through `bonsai::int8_all_reduce` (idempotent; no-op when off)."""
    from vllm.distributed.parallel_state import GroupCoordinator

    if getattr(GroupCoordinator, "_bonsai_int8", False) or not enabled():
        return
    original = GroupCoordinator._all_reduce_out_place
    rows = min_tokens()

    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        if self.unique_name.startswith("tp:") and self.world_size > 1:
            return torch.ops.bonsai.int8_all_reduce(input_, self.unique_name, rows)
        return original(self, input_)

    GroupCoordinator._all_reduce_out_place = _all_reduce_out_place
    GroupCoordinator._bonsai_int8 = True
    logger.info("int8 all-reduce on for payloads of >= %d rows (BONSAI_AR_INT8=0 turns it off)", rows)
