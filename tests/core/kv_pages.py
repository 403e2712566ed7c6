"""Shuffled KV pages for the K3V2 kernel tests: which physical block holds each sequence's tokens."""

from __future__ import annotations

import torch


def shuffled_block_table(lens: list[int] | tuple[int, ...], block_size: int, extra_blocks: int,
                         gen: torch.Generator) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """Blocks in a random order, so that a kernel that ignores the block table reads the wrong tokens.

    Returns (number of blocks, block table int32 [B, max blocks] on the CPU, per sequence the slot of each
    token: int64 [len]).
    """
    blocks = [-(-n // block_size) for n in lens]
    total = sum(blocks) + extra_blocks
    perm = torch.randperm(total, generator=gen)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    slots, at = [], 0
    for b, (n, m) in enumerate(zip(lens, blocks)):
        table[b, :m] = perm[at:at + m].int()
        at += m
        t = torch.arange(n)
        slots.append(table[b].long()[t // block_size] * block_size + t % block_size)
    return total, table, slots
