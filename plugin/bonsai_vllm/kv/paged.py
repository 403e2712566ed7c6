"""K3V2 in a serving engine's block pool: every page carries its own bf16 sinks and recent ring.

`cache.LayerKVCache` keeps the bf16 part (sinks + recent window) in a per-sequence buffer. A paged engine
(vLLM) gives an attention backend no stable per-request slot: only the block table, the slot of each new
token and the sequence lengths of the step. So here each (block, KV head) page holds, after the packed
K3V2 slots of its `block_size` tokens (format.py's layout, what store.py and decode.py read), a small
bf16 area written from the slot alone:

    quantized  block_size × slot_bytes     every token, at its slot (168 B at D = 256)
    sinks      sink × 2·D bf16             offsets [0, sink) of the block (block 0's are the sequence's sinks)
    ring       ring × 2·D bf16             offset o goes to ring slot o % ring: the block's newest tokens

The bf16 area is a fixed share of the page, `D / 8` bytes per token per KV head (one bf16 K+V token per
32 tokens, +19% over the 168 B at D = 256), so vLLM's page size stays linear in the block size (its
hybrid block-size alignment and pool sizing assume that): content_bytes(K3V2) = 200 at D = 256.
The ring length therefore grows with the block: at the 27B's hybrid-aligned block (2176 tokens at
TP=2, kernel block 128) there are 68 bf16 slots: 4 sinks and a ring of 64, a recent window of 60 with the
guard of 4.

What attention sees (`exact_mask`): for a sequence of L tokens whose newest QL are this step's queries,
positions [0, sink) and [L - max(window, QL), L) are exact (bf16, rotated), every other position is
dequantized from its slot; causal inside the step's tokens. `window` = ring - guard is what the rings
always hold: the newest `ring` offsets of the last block, continued by the previous block's tail. The
guard (>= the number of speculative tokens) keeps rejected draft tokens out: a rejected token at offset
o has overwritten ring slot o % ring, which belongs to offset o - ring; the next step re-writes offsets
from o on, but only as many as it schedules, so the oldest `guard` ring positions are not trusted. The
vLLM backend uses guard = max(4, k), so the window is the same with speculative decoding on and off.

Rows: a decode row (QL = 1) and a speculative verify row (QL = 1 + k) are the same thing here: their
queries are the newest tokens, inside the window, so `decode` serves both (grouped kernel or reference,
with the sinks' page tokens skipped by q_start); a prefill row (QL > window) is computed by `prefill_row`
(dequantize the context, exact own tokens, causal attention). Both follow the one rule above, so a
verify row computed either way gives the same result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bonsai_vllm.kv import reference as ref
from bonsai_vllm.kv.format import KVFormat

BF16_SHARE = 32  # one bf16 K+V token slot (4·D bytes) per this many tokens of page
# Prefill attention takes the keys in chunks: at most this many float32 scores at once (64 MiB), and
# chunks of at least this many tokens.
PREFILL_MAX_SCORES = 1 << 24
PREFILL_MIN_CHUNK = 16


def content_bytes(fmt: KVFormat) -> int:
    """Bytes per token per KV head of a page: the packed slot plus the bf16 area's share (200 at D = 256)."""
    return fmt.slot_bytes + 4 * fmt.head_dim // BF16_SHARE


@dataclass(frozen=True)
class PagedK3V2:
    """The page geometry of one layer: fmt, block_size, and the speculative guard."""

    fmt: KVFormat
    block_size: int
    guard: int = 0  # speculative tokens per step (rejected drafts may sit in the oldest ring slots)

    @property
    def content(self) -> int:
        return content_bytes(self.fmt)

    @property
    def quant_bytes(self) -> int:
        return self.fmt.page_bytes(self.block_size)

    @property
    def page_bytes(self) -> int:
        return self.block_size * self.content

    @property
    def bf16_slots(self) -> int:
        return (self.page_bytes - self.quant_bytes) // (4 * self.fmt.head_dim)

    @property
    def sink(self) -> int:
        return min(self.fmt.sink, self.block_size)

    @property
    def ring(self) -> int:
        return self.bf16_slots - self.sink

    @property
    def window(self) -> int:
        return self.ring - self.guard

    def validate(self) -> None:
        if self.window < 1:
            raise ValueError(f"K3V2 pages of {self.block_size} tokens hold {self.bf16_slots} bf16 slots: "
                             f"{self.sink} sinks + a ring of {self.ring} leave no recent window with "
                             f"{self.guard} speculative tokens (needs block_size >= "
                             f"{BF16_SHARE * (self.sink + self.guard + 1)})")

    # ------------------------------------------------------------------------------------- views
    def views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cache uint8 [num_blocks, Hkv, page_bytes] (any block stride) -> (quantized pages
        [num_blocks, Hkv, block_size · slot_bytes] as store/decode read them, bf16 area
        [num_blocks, Hkv, bf16_slots, 2, D]: sinks first, then the ring; [..., 0, :] K, [..., 1, :] V)."""
        if cache.shape[-1] != self.page_bytes or cache.dtype != torch.uint8:
            raise ValueError(f"K3V2 cache {tuple(cache.shape)} {cache.dtype}: expected uint8 pages of "
                             f"{self.page_bytes} bytes ({self.block_size} tokens x {self.content})")
        nb, hkv = cache.shape[:2]
        d = self.fmt.head_dim
        q = cache[:, :, :self.quant_bytes]
        bf = cache[:, :, self.quant_bytes:self.quant_bytes + self.bf16_slots * 4 * d].view(torch.bfloat16)
        return q, bf.view(nb, hkv, self.bf16_slots, 2, d)

    # ------------------------------------------------------------------------------------- store
    def write(self, cache: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor, slots: torch.Tensor,
              use_kernels: bool = False) -> None:
        """Rotated k, v [T, Hkv, D] (float32) -> their slots [T] (< 0: skipped): the packed slot, the
        ring slot of their offset, and the sink slot when the offset is < sink."""
        qpages, bf = self.views(cache)
        if use_kernels:
            from bonsai_vllm.kv.kernels.store import store

            store(qpages, k_rot.contiguous(), v_rot.contiguous(), slots, self.fmt, self.block_size)
        else:
            ref.store_ref(qpages, k_rot, v_rot, slots, self.fmt, self.block_size)
        keep = slots >= 0
        if not bool(keep.all()):
            k_rot, v_rot, slots = k_rot[keep], v_rot[keep], slots[keep]
        slots = slots.long()
        blk, off = slots // self.block_size, slots % self.block_size
        kv = torch.stack([k_rot, v_rot], dim=2).to(torch.bfloat16)  # [T, Hkv, 2, D]
        heads = torch.arange(kv.shape[1], device=kv.device)
        # A chunk longer than the ring maps several of its tokens to one ring slot; an indexed store with
        # repeated indices keeps an unspecified one of them, so write only each block's newest `ring`
        # tokens of this batch (one block is written by one sequence per step; its offsets only grow).
        newest = torch.full((cache.shape[0],), -1, dtype=off.dtype, device=off.device)
        newest = newest.scatter_reduce(0, blk, off, reduce="amax")
        last = off > newest[blk] - self.ring
        ring_slot = self.sink + off % self.ring
        bf[blk[last][:, None], heads[None, :], ring_slot[last][:, None]] = kv[last]
        s = off < self.sink
        if bool(s.any()):
            bf[blk[s][:, None], heads[None, :], off[s][:, None]] = kv[s]

    # ------------------------------------------------------------------------------------- reads
    def exact_mask(self, seq_len: int, q_len: int) -> torch.Tensor:
        """bool [seq_len]: positions attention takes in bf16 (the rest are dequantized)."""
        p = torch.arange(seq_len)
        return (p < self.sink) | (p >= seq_len - max(self.window, q_len))

    def _bf16_at(self, bf: torch.Tensor, block_table: torch.Tensor, pos: torch.Tensor, sink: torch.Tensor):
        """bf16 K/V [..., Hkv, 2, D] of positions pos [...] of the sequences whose block table rows are
        block_table [..., max_blocks] (broadcast), from the sink slot where sink is True, else the ring."""
        blk = torch.gather(block_table.long(), -1, (pos // self.block_size).clamp_min(0)[..., None])[..., 0]
        off = pos % self.block_size
        slot = torch.where(sink, off, self.sink + off % self.ring)
        return bf[blk, :, slot]  # [..., Hkv, 2, D]

    def window_buffers(self, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor):
        """For decode/verify rows: (win_k, win_v [B, Hkv, sink + window, D] bf16, n_win [B] int32,
        n_quant [B] int32) as decode/decode_ref take them: the sinks, then the newest tokens (the row's
        queries among them), n_quant = the page tokens before the window. All tensor ops (no host sync)."""
        _, bf = self.views(cache)
        b = seq_lens.shape[0]
        wcap = self.sink + self.window
        L = seq_lens.long()[:, None]  # [B, 1]
        s_b = L.clamp(max=self.sink)  # sinks present
        w_b = (L - s_b).clamp(max=self.window)  # recent tokens in the window
        i = torch.arange(wcap, device=cache.device)[None, :]  # [1, wcap]
        is_sink = i < s_b
        pos = torch.where(is_sink, i, L - w_b + (i - s_b))
        valid = i < s_b + w_b
        pos = torch.where(valid, pos, torch.zeros_like(pos))
        kv = self._bf16_at(bf, block_table[:b, None, :].expand(b, wcap, -1), pos, is_sink)  # [B, wcap, Hkv, 2, D]
        kv = torch.where(valid[:, :, None, None, None], kv, torch.zeros_like(kv))
        win_k = kv[:, :, :, 0].transpose(1, 2).contiguous()
        win_v = kv[:, :, :, 1].transpose(1, 2).contiguous()
        n_win = (s_b + w_b)[:, 0].to(torch.int32)
        n_quant = (L - w_b)[:, 0].to(torch.int32)
        return win_k, win_v, n_win, n_quant

    def decode(self, q_rot: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               sm_scale: float, use_kernels: bool = False, **kernel_kw) -> torch.Tensor:
        """Decode or verify rows, q_rot [B, QL, Hq, D] (QL <= window; the queries are each sequence's
        newest QL tokens, already written) -> rotated output [B, QL, Hq, D] float32."""
        ql = q_rot.shape[1]
        if ql > self.window:
            raise ValueError(f"decode: {ql} query tokens per row exceed the bf16 window of {self.window}")
        win_k, win_v, n_win, n_quant = self.window_buffers(cache, block_table, seq_lens)
        qpages, _ = self.views(cache)
        args = (q_rot.contiguous(), qpages, block_table, n_quant, win_k, win_v, n_win, self.fmt, self.block_size,
                sm_scale)
        if use_kernels:
            from bonsai_vllm.kv.kernels.decode import decode

            return decode(*args, q_start=self.sink, **kernel_kw)
        return ref.decode_ref(*args, q_start=self.sink)

    def prefill_row(self, q_rot: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor, cache: torch.Tensor,
                    block_table_row: torch.Tensor, seq_len: int, sm_scale: float,
                    max_scores: int = PREFILL_MAX_SCORES, use_kernels: bool = False) -> torch.Tensor:
        """One row of QL query tokens, the newest of seq_len (q_rot [QL, Hq, D]; its own rotated k, v
        [QL, Hkv, D], already written): the context [0, seq_len - QL) read back from the pages (exact
        where exact_mask says, dequantized elsewhere), its own tokens exact (bf16-rounded as the ring
        keeps them), causal attention -> rotated output [QL, Hq, D] float32.

        Memory stays bounded at any context length: the keys are taken in chunks of C tokens with
        QL·Hq·C <= max_scores (C >= PREFILL_MIN_CHUNK), each chunk dequantized on its own and folded into
        a running softmax (max, sum, accumulator in float32). Reading 130k tokens of context at once
        would need 1 GB of keys and values and QL·Hq·130k scores per layer, more than a 12 GB card has.

        use_kernels: the grouped decode kernel instead (`_prefill_row_kernel`), same rule."""
        if use_kernels:
            return self._prefill_row_kernel(q_rot, k_rot, v_rot, cache, block_table_row, seq_len, sm_scale)
        ql, hq, d = q_rot.shape
        hkv = k_rot.shape[1]
        g = hq // hkv
        n_ctx = seq_len - ql
        dev = q_rot.device
        own_k = k_rot.to(torch.bfloat16).float()
        own_v = v_rot.to(torch.bfloat16).float()
        exact = self.exact_mask(seq_len, ql).to(dev)
        qpages, bf = self.views(cache)
        q = (q_rot.float() * sm_scale).reshape(ql, hkv, g, d)
        q_pos = n_ctx + torch.arange(ql, device=dev)  # [QL]
        m = torch.full((ql, hkv, g), -math.inf, device=dev)
        denom = torch.zeros(ql, hkv, g, device=dev)
        acc = torch.zeros(ql, hkv, g, d, device=dev)
        chunk = max(PREFILL_MIN_CHUNK, max_scores // max(1, ql * hq))
        for a in range(0, seq_len, chunk):
            b = min(seq_len, a + chunk)
            keys, vals = self._keys_values(qpages, bf, block_table_row, a, b, n_ctx, exact, own_k, own_v)
            s = torch.einsum("qhgd,nhd->qhgn", q, keys)  # [QL, Hkv, G, C]
            vis = torch.arange(a, b, device=dev)[None, :] <= q_pos[:, None]  # causal [QL, C]
            s = s.masked_fill(~vis[:, None, None, :], -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            # rows that have seen no key yet keep m = -inf; exp(-inf - -inf) would be NaN
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - safe[..., None])
            corr = torch.exp(m - safe)
            denom = denom * corr + p.sum(-1)
            acc = acc * corr[..., None] + torch.einsum("qhgn,nhd->qhgd", p, vals)
            m = m_new
        return (acc / denom[..., None]).reshape(ql, hq, d)

    def _prefill_row_kernel(self, q_rot: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor,
                            cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int,
                            sm_scale: float) -> torch.Tensor:
        """prefill_row through the grouped decode kernel: the row's QL queries are cut into sub-rows of r
        (r·group <= 16, the kernel's tensor-core tile), all reading the same pages and one shared bf16
        window (the sinks, then the exact tail: the row's own tokens, or for QL <= window the ring's
        newest tokens), each sub-row seeing the window up to its own last query. No float copy of the
        context is made: the pages are read as the decode kernel reads them, from L2 after the first
        sub-row (the 27B's 130k-token context is 44 MB per layer and rank)."""
        from bonsai_vllm.kv.kernels.decode import auto_splits, decode

        ql, hq, d = q_rot.shape
        hkv = k_rot.shape[1]
        group = hq // hkv
        n_ctx = seq_len - ql
        dev = q_rot.device
        qpages, bf = self.views(cache)
        if ql <= self.window:  # the exact tail reaches into the context: the ring holds it (and the row)
            win_k, win_v, _, _ = self.window_buffers(cache, block_table_row[None, :],
                                                     torch.tensor([seq_len], device=dev))
            s_b = min(self.sink, seq_len)  # as window_buffers counts them, on the host (no sync)
            w_b = min(seq_len - s_b, self.window)
            n_win, n_quant = s_b + w_b, seq_len - w_b
        else:  # exact tail = the row's own tokens; before them the sinks that are context
            s_b = min(self.sink, n_ctx)
            pos = torch.arange(s_b, device=dev)
            sinks = self._bf16_at(bf, block_table_row[None, :].expand(s_b, -1), pos, pos < self.sink)
            own = torch.stack([k_rot, v_rot], dim=2).to(torch.bfloat16)  # [QL, Hkv, 2, D]
            kv = torch.cat([sinks, own]).permute(2, 1, 0, 3)  # [2, Hkv, s_b + QL, D]
            win_k, win_v = kv[0][None].contiguous(), kv[1][None].contiguous()
            n_win, n_quant = s_b + ql, n_ctx
        r = max(1, 16 // group)
        out = torch.empty(ql, hq, d, dtype=torch.float32, device=dev)
        full = ql - ql % r
        for a, rows, sub in ((0, full // r, r), (full, 1, ql - full)):  # sub-rows of r, then the remainder
            if rows == 0 or sub == 0:
                continue
            b = a + rows * sub
            q = q_rot[a:b].reshape(rows, sub, hq, d)
            # sub-row i holds queries [a + i·sub, a + (i+1)·sub): it sees the window up to its last query
            ends = a + sub * torch.arange(1, rows + 1, device=dev, dtype=torch.int32)
            nw = (n_win - ql + ends).to(torch.int32)
            nq = torch.full((rows,), n_quant, dtype=torch.int32, device=dev)
            splits = auto_splits(n_quant, rows, hkv)
            o = decode(q, qpages, block_table_row[None, :].expand(rows, -1), nq,
                       win_k.expand(rows, -1, -1, -1), win_v.expand(rows, -1, -1, -1), nw, self.fmt,
                       self.block_size, sm_scale, q_start=self.sink, num_splits=splits)
            out[a:b] = o.reshape(b - a, hq, d)
        return out

    def _keys_values(self, qpages: torch.Tensor, bf: torch.Tensor, block_table_row: torch.Tensor, a: int, b: int,
                     n_ctx: int, exact: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor):
        """Keys and values of positions [a, b) as prefill attention sees them: float32 [b - a, Hkv, D]."""
        parts_k, parts_v = [], []
        c = min(b, n_ctx)
        if a < c:  # context: dequantized, or the bf16 copy where the rule says exact
            kd, vd = ref.decode_slots(ref.gather_ref(qpages, block_table_row, c, self.fmt, self.block_size,
                                                     start=a), self.fmt)
            pos = torch.arange(a, c, device=qpages.device)
            kv = self._bf16_at(bf, block_table_row[None, :].expand(c - a, -1), pos, pos < self.sink)
            ex = exact[a:c, None, None]
            parts_k.append(torch.where(ex, kv[:, :, 0].float(), kd))
            parts_v.append(torch.where(ex, kv[:, :, 1].float(), vd))
        if b > n_ctx:  # the row's own tokens
            parts_k.append(own_k[max(a, n_ctx) - n_ctx:b - n_ctx])
            parts_v.append(own_v[max(a, n_ctx) - n_ctx:b - n_ctx])
        if len(parts_k) == 1:
            return parts_k[0], parts_v[0]
        return torch.cat(parts_k), torch.cat(parts_v)
