"""The block Hadamard rotation when tensor parallelism splits a layer's input.

A row-parallel layer (o_proj, GDN out_proj, down_proj) gives each of `tp` ranks a contiguous slice of the
input of width `in/tp`. The rotation y = H(s ⊙ x) works on 1024-wide blocks; a block that lies wholly
inside a rank's slice is rotated locally. With the 27B at TP=2, down_proj's 17408 → 8704 per rank cuts
block 8 in the middle: rank 0 holds its first half `a`, rank 1 its second half `b`. Sylvester's
construction H_2n = [[H_n, H_n], [H_n, −H_n]] / √2 gives

    H_1024 [a; b] = [H_512 a + H_512 b ; H_512 a − H_512 b] / √2

so each rank rotates its own half, the halves are exchanged (one all-gather), and rank 0 keeps the sum,
rank 1 the difference. Nothing else changes: each rank multiplies its rotated slice by its weight columns
and the usual all-reduce sums the partial outputs.

`plan_partition` checks the geometry once at load time; `rotate_partition` runs it. The exchange is a
callable so this module stays free of vLLM: the adapter passes vLLM's TP all-gather, tests pass a local one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from bonsai_vllm.ternary.reference import fwht

# exchange(t) -> all ranks' `t` concatenated along the last dimension, in rank order.
Exchange = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PartitionPlan:
    """Where a rank's input slice meets the Hadamard blocks.

    The slice is `[head | whole blocks | tail]`: `head` elements finish a block that the previous rank
    started, `tail` elements start a block that the next rank finishes (each half a block at TP=2).
    """

    width: int  # this rank's input width
    block: int
    head: int
    tail: int

    @property
    def cut(self) -> bool:
        return bool(self.head or self.tail)


def plan_partition(full_width: int, tp_size: int, tp_rank: int, block: int) -> PartitionPlan:
    """Check that `full_width` split over `tp_size` ranks can be rotated; raise ValueError if not."""
    if full_width % block:
        raise ValueError(f"input width {full_width} is not a multiple of the Hadamard block {block}")
    if full_width % tp_size:
        raise ValueError(f"input width {full_width} does not split evenly over tensor-parallel size {tp_size}")
    width = full_width // tp_size
    start = tp_rank * width
    head = (-start) % block
    tail = (start + width) % block
    if head or tail:
        # Only a cut exactly in the middle of a block between two ranks is implemented (always the case
        # for TP=2: in/2 mod block is 0 or block/2). Finer cuts would need the k-way Sylvester split.
        half = block // 2
        if tp_size != 2 or (head not in (0, half)) or (tail not in (0, half)):
            raise ValueError(
                f"tensor-parallel size {tp_size} cuts the {block}-wide Hadamard blocks of a {full_width}-wide "
                f"input at offsets other than the middle (rank {tp_rank}: {head} elements before its first "
                f"whole block, {tail} after its last). Only TP=1 and TP=2 are supported for this layer; "
                "use --tensor-parallel-size 2 or 1")
    return PartitionPlan(width=width, block=block, head=head, tail=tail)


def rotate_partition(x: torch.Tensor, signs: torch.Tensor, plan: PartitionPlan, tp_rank: int,
                     exchange: Exchange) -> torch.Tensor:
    """This rank's slice of H(s ⊙ x_full), given its slice x [..., width] and its signs [width].

    Every rank must call this for the same layer (the exchange is a collective), even a rank whose
    slice has no cut — at TP=2 both ranks hold one half of the cut block, so both always exchange.
    """
    xs = x.float() * signs  # [..., width]
    if not plan.cut:
        return fwht(xs, plan.block).to(x.dtype)
    half = plan.block // 2
    # Rank 0's cut piece is its tail, rank 1's is its head; both are `half` wide.
    lo, hi = (plan.head, plan.width - plan.tail)
    whole = fwht(xs[..., lo:hi], plan.block) if hi > lo else xs[..., lo:hi]
    piece = xs[..., hi:] if tp_rank == 0 else xs[..., :lo]  # [..., half]
    y_local = fwht(piece, half)  # H_half of this rank's half of the cut block
    both = exchange(y_local.contiguous())  # [..., 2·half]: rank 0's then rank 1's
    y0, y1 = both[..., :half], both[..., half:]
    combined = (y0 + y1) if tp_rank == 0 else (y0 - y1)
    combined = combined * (1.0 / math.sqrt(2.0))
    parts = [whole, combined] if tp_rank == 0 else [combined, whole]
    return torch.cat(parts, dim=-1).to(x.dtype)
