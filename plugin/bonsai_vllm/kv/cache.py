"""One full-attention layer's KV cache as a serving engine keeps it: quantized pages + a bf16 recent window.

For tests and the benchmark (the vLLM backend keeps the same two parts in its own buffers). Per sequence:
- pages: tokens [0, n_quant) quantized (format.py layout), reached through a block table whose blocks
  come from a shuffled free list, so page indirection is really exercised;
- bf16 buffer ([B, Hkv, Wcap, D], rotated, n_win tokens): the first `sink` tokens of the sequence, then
  its newest tokens. After an append that leaves window + flush or more recent tokens, the oldest of
  them beyond `window` are quantized into pages in one store. Pages therefore hold positions
  [sink, sink + n_quant): attention does not care where a token is stored (RoPE is already applied),
  only that the verify rows' own tokens are the newest of the buffer.

`use_kernels` picks the Triton kernels (store.py, decode.py) or the reference (reference.py) for both the
store and the attention; everything else (rotation, window bookkeeping) is shared, so the two paths
see the same numbers.
"""

from __future__ import annotations

import torch

from bonsai_vllm.kv import reference as ref
from bonsai_vllm.kv.format import KVFormat
from bonsai_vllm.kv.rotation import KVRotation


class LayerKVCache:
    def __init__(self, fmt: KVFormat, rotation: KVRotation, num_kv_heads: int, block_size: int,
                 num_blocks: int, max_batch: int, device="cpu", use_kernels: bool = False, seed: int = 0):
        if fmt.window == 0 and fmt.flush != 1:
            fmt = fmt.with_(flush=1)  # no recent window: every token goes to the pages at once
        self.fmt, self.rot, self.hkv, self.bs = fmt, rotation.to(device), num_kv_heads, block_size
        self.device, self.use_kernels = device, use_kernels
        self.cache = ref.new_cache(fmt, num_blocks, block_size, num_kv_heads, device)
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()
        self.max_blocks = num_blocks
        self.block_table = torch.zeros(max_batch, num_blocks, dtype=torch.int32, device=device)
        self.n_blocks = [0] * max_batch
        self.n_quant = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.n_win = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.n_sink = [0] * max_batch
        wcap = max(1, fmt.sink + fmt.window + fmt.flush)
        self.win_k = torch.zeros(max_batch, num_kv_heads, wcap, fmt.head_dim, dtype=torch.bfloat16, device=device)
        self.win_v = torch.zeros_like(self.win_k)

    def _slots(self, b: int, start: int, n: int) -> torch.Tensor:
        need = -(-(start + n) // self.bs)
        while self.n_blocks[b] < need:
            if not self.free:
                raise RuntimeError("LayerKVCache: out of blocks")
            self.block_table[b, self.n_blocks[b]] = self.free.pop()
            self.n_blocks[b] += 1
        t = torch.arange(start, start + n, device=self.device)
        return (self.block_table[b].long()[t // self.bs] * self.bs + t % self.bs).to(torch.int32)

    def _store(self, k_rot: torch.Tensor, v_rot: torch.Tensor, slots: torch.Tensor) -> None:
        if self.use_kernels:
            from bonsai_vllm.kv.kernels.store import store

            store(self.cache, k_rot.contiguous(), v_rot.contiguous(), slots, self.fmt, self.bs)
        else:
            ref.store_ref(self.cache, k_rot, v_rot, slots, self.fmt, self.bs)

    def append(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add tokens k, v [T, Hkv, D] (post-RoPE, unrotated) to sequence b."""
        kr, vr = self.rot.rotate_k(k.to(self.device)), self.rot.rotate_v(v.to(self.device))  # fp32
        nw, ns = int(self.n_win[b]), self.n_sink[b]
        kr = torch.cat([self.win_k[b, :, :nw].transpose(0, 1).float(), kr])  # [nw + T, Hkv, D]: sinks first
        vr = torch.cat([self.win_v[b, :, :nw].transpose(0, 1).float(), vr])
        ns = min(self.fmt.sink, kr.shape[0]) if self.fmt.sink else 0  # the sequence's first tokens
        self.n_sink[b] = ns
        n = kr.shape[0] - ns  # recent tokens
        n_out = n - self.fmt.window if n >= self.fmt.window + self.fmt.flush else 0
        if n_out:
            nq = int(self.n_quant[b])
            self._store(kr[ns:ns + n_out], vr[ns:ns + n_out], self._slots(b, nq, n_out))
            self.n_quant[b] = nq + n_out
        keep = torch.cat([torch.arange(ns), torch.arange(ns + n_out, kr.shape[0])]).to(kr.device)
        if keep.numel() > self.win_k.shape[2]:
            raise RuntimeError("LayerKVCache: window overflow")
        self.win_k[b, :, :keep.numel()] = kr[keep].transpose(0, 1).to(torch.bfloat16)
        self.win_v[b, :, :keep.numel()] = vr[keep].transpose(0, 1).to(torch.bfloat16)
        self.n_win[b] = keep.numel()

    def attend(self, q: torch.Tensor, sm_scale: float, **kernel_kw) -> torch.Tensor:
        """q [B, QL, Hq, D] (post-RoPE; its QL tokens already appended) -> output [B, QL, Hq, D] float32."""
        bsz, ql = q.shape[:2]
        if ql > 1 and bool((self.n_win[:bsz] < ql).any()):
            raise ValueError("attend: verify rows must be inside the bf16 window (window >= QL)")
        q_rot = self.rot.rotate_q(q.to(self.device)).contiguous()
        args = (q_rot, self.cache, self.block_table[:bsz], self.n_quant[:bsz], self.win_k[:bsz], self.win_v[:bsz],
                self.n_win[:bsz], self.fmt, self.bs, sm_scale)
        if self.use_kernels:
            from bonsai_vllm.kv.kernels.decode import decode

            o_rot = decode(*args, **kernel_kw)
        else:
            o_rot = ref.decode_ref(*args)
        return self.rot.unrotate_out(o_rot)
