"""`make gpu-check`: every kernel the served path can launch, through the entry points the adapters call, at
the 27B's per-rank TP=2 shapes, against the references. One table; exit status 1 on any failure.

    PYTHONPATH=plugin python -m tools.gpu_check [--out DIR] [--only linear,kv,allreduce,...]

Run it on a CUDA GPU after every change to a kernel or an adapter. What it calls, and who calls that:

| section    | entry point (the adapter that calls it)                                  | judged against            |
|------------|--------------------------------------------------------------------------|---------------------------|
| linear     | kernels.linear.ternary_linear; partition.rotate_partition for down_proj's | Hadamard, then x · W'ᵀ in |
|            | cut block, both ranks, outputs summed (adapters/quantization.py)          | float32                   |
| kv store   | PagedK3V2.write(use_kernels=True) (adapters/k3v2_attention.py)            | write(use_kernels=False)  |
| kv decode  | PagedK3V2.decode, split count from kv.decode.auto_splits as the adapter   | reference.decode_ref,     |
|            | computes it, decode rows and MTP verify rows                              | float64                   |
| kv prefill | PagedK3V2.prefill_row(use_kernels=True), the CUDA default                 | the chunked torch route   |
| allreduce  | kernels.allreduce.tp_all_reduce, two ranks in two threads                 | the exact sum, its bound  |
| hadamard   | kernels.hadamard.block_hadamard / quantize_per_token                      | ternary.reference (float32)   |
| embeddings | embeddings.lookup / lookup_device_only over a real-size export            | the dense table, bitwise  |

Row counts are those the scheduler can produce with `.env.example`'s knobs: every decode batch from 1 to
SEQS · (1 + MTP) = 48 rows, and prefill chunks up to MAX_BATCHED_TOKENS = 2048; contexts from a few tokens
to MAX_MODEL_LEN = 131072, mixed lengths in one batch, blocks in a shuffled order. Every case draws fresh
random inputs; outputs are poisoned (NaN) first where the entry point takes an `out`, and the allocator's
free memory is poisoned before the others, so an element never written fails the check. The "route"
column is the dispatch decision the entry point took (kernel and configuration). Switches are read as the
server reads them: `BONSAI_CODES_GEMM=1 make gpu-check` sends the prefill rows without W8 through the GEMM
that decodes the codes itself ("int8 codes …" routes) instead of the per-call expansion.

`--smoke` runs the same code at toy sizes on the CPU through Triton's interpreter (tests/core), which keeps
this script from rotting; only the GPU run at the real sizes counts (docs/benchmarks.md has the last one).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

SEED = int(time.time()) % 100000  # fresh data every run; printed, so a failure can be replayed (--seed)


@dataclass
class Case:
    section: str
    name: str
    route: str
    error: float
    bound: float
    ok: bool
    note: str = ""


@dataclass
class Sizes:
    """The real sizes (default) or the smoke test's toy sizes."""

    hidden: int = 5120
    layers: list = field(default_factory=lambda: [
        # (name, full input width, outputs per rank, row-parallel: the rank holds half the input)
        ("gate_up", 5120, 17408, False), ("down", 17408, 5120, True), ("qkv", 5120, 7168, False),
        ("o_proj", 6144, 5120, True), ("gdn_in", 5120, 8192, False), ("gdn_out", 6144, 5120, True),
        ("lm_head", 5120, 124160, False)])
    decode_rows: list = field(default_factory=lambda: list(range(1, 49)))
    prefill_rows: list = field(default_factory=lambda: [49, 63, 64, 65, 128, 129, 256, 511, 512, 1024, 1500,
                                                        2047, 2048])
    lm_head_rows: list = field(default_factory=lambda: list(range(1, 49)))
    # K3V2: one TP=2 rank's heads, the 27B's served block (vLLM's hybrid alignment at kernel block 128)
    hq: int = 12
    hkv: int = 2
    head_dim: int = 256
    block_size: int = 2176
    guard: int = 4
    max_model_len: int = 131072
    short_lens: list = field(default_factory=lambda: [1, 3, 4, 5, 59, 60, 61, 64, 65, 100, 2175, 2176, 2177, 4353])
    n_long: int = 35  # sequences drawn between 8k and max_model_len (with the short ones: 48 of >= 2 tokens)
    decode_batches: list = field(default_factory=lambda: [(1, 1), (2, 1), (3, 1), (8, 1), (16, 1), (24, 1), (47, 1),
                                                          (48, 1), (1, 2), (8, 2), (12, 2), (24, 2)])
    prefill_cases: list = field(default_factory=lambda: [
        (0, 2048), (3, 37), (4000, 37), (8192, 512), (32768, 512), (130560, 512), (129024, 2048), (40000, 20),
        (60000, 1), (60000, 60), (60000, 61), (100000, 2048)])  # (context, QL)
    store_lens: list = field(default_factory=lambda: [5000, 2177, 300])
    store_chunks: list = field(default_factory=lambda: [2048, 1, 7, 64, 513])
    allreduce_rows: list = field(default_factory=lambda: [1, 2, 24, 48, 127, 128, 129, 512, 2048])
    hadamard_widths: list = field(default_factory=lambda: [5120, 3072, 8192])
    hadamard_rows: list = field(default_factory=lambda: [1, 48, 2048])
    rotate_prep_rows: list = field(default_factory=lambda: [1, 2, 3, 8, 17, 33, 48, 64])
    vocab: int = 248320
    hot_vocab: int = 32000
    embed_batches: list = field(default_factory=lambda: [1, 48, 2048])


def smoke_sizes() -> Sizes:
    return Sizes(hidden=1024,
                 layers=[("gate_up", 1024, 256, False), ("down", 3072, 128, True), ("lm_head", 1024, 512, False)],
                 decode_rows=[1, 2, 3], prefill_rows=[65], lm_head_rows=[1, 2], hq=6, hkv=1, head_dim=64,
                 block_size=256, guard=1, max_model_len=900, short_lens=[1, 5, 300], n_long=1,
                 decode_batches=[(3, 1), (2, 2)], prefill_cases=[(0, 40), (300, 9)], store_lens=[300],
                 store_chunks=[97, 1], allreduce_rows=[1, 128], hadamard_widths=[1024], hadamard_rows=[2],
                 vocab=600, hot_vocab=64, embed_batches=[5])


class Checker:
    def __init__(self, device: str, sizes: Sizes, seed: int):
        self.dev = device
        self.sz = sizes
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.cases: list[Case] = []
        self.t0 = time.time()

    # ------------------------------------------------------------------------------------- helpers
    def randn(self, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen, device=self.dev) * scale).to(dtype)

    def poison_free_memory(self, nbytes: int) -> None:
        """Fill a block of the caching allocator with NaN and free it: an output allocated next from it that
        a kernel fails to write keeps the NaN (the rel-error check treats a NaN as a failure)."""
        if self.dev == "cuda" and nbytes > 0:
            torch.full((nbytes // 4 + 1,), float("nan"), device=self.dev)

    def add(self, section: str, name: str, route: str, error: float, bound: float, note: str = "") -> bool:
        ok = bool(error <= bound) and math.isfinite(error)
        self.cases.append(Case(section, name, route, float(error), float(bound), ok, note))
        if not ok:
            print(f"  FAIL {section} {name} [{route}]: {error:.3g} > {bound:.3g} {note}", flush=True)
        return ok

    def guard(self, section: str, name: str, fn, *args, **kw):
        """A case that raises (a kernel that does not compile here, say) is a failure, and the run goes on."""
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - recorded as a failed case and printed
            self.add(section, name, "raised", math.inf, 0.0, f"{type(e).__name__}: {str(e)[:300]}")
            return None

    # ------------------------------------------------------------------------------------- linear
    def linear(self) -> None:
        from bonsai_vllm.ternary.format import pack_ternary
        from bonsai_vllm.ternary.reference import signed_block_hadamard
        from bonsai_vllm.ternary.kernels import linear
        from bonsai_vllm.ternary.partition import plan_partition
        from bonsai_vllm.ternary.reference import dequantize

        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"[{self.elapsed():.0f} s] linear layers", flush=True)
        for name, k_full, n, row_parallel in self.sz.layers:
            codes = torch.randint(-1, 2, (n, k_full), generator=self.gen, device=self.dev, dtype=torch.int8)
            scales = (0.01 + 0.04 * torch.rand(n, k_full // 128, generator=self.gen, device=self.dev)).half()
            signs = torch.randint(0, 2, (k_full,), generator=self.gen, device=self.dev).float() * 2 - 1
            w_full = dequantize(pack_ternary(codes), scales, 128)  # float32 [N, K]
            ranks = 2 if row_parallel else 1
            width = k_full // ranks
            plans = [plan_partition(k_full, ranks, r, 1024) for r in range(ranks)]
            tws = {}
            for w8 in (False, True):
                tws[w8] = [linear.prepare(pack_ternary(codes[:, r * width:(r + 1) * width].contiguous()),
                                          scales[:, r * width // 128:(r + 1) * width // 128].contiguous(),
                                          signs[r * width:(r + 1) * width], expand_int8=w8) for r in range(ranks)]
            # The GEMV at decode rows as BONSAI_DP4A_GEMV=0 / BONSAI_MMA_GEMM=0 serve them (the defaults are
            # the dp4a GEMV and the mma kernel)
            tws["fma"] = [linear.prepare(t.packed, t.scales, t.signs, dp4a=False, mma=False) for t in tws[False]]
            del codes
            rows = self.sz.lm_head_rows if name == "lm_head" else self.sz.decode_rows + self.sz.prefill_rows
            for w8 in (False, True):
                for m in rows:
                    self.guard("linear", f"{name} M={m}", self._linear_case, name, m, k_full, n, signs, w_full,
                               plans, tws[w8], linear, signed_block_hadamard)
            for m in (1, 2, 3, 16, 48):  # rows of the dp4a and mma routes, on the
                # routes they replaced
                self.guard("linear", f"{name} M={m} BONSAI_DP4A_GEMV=0 BONSAI_MMA_GEMM=0", self._linear_case,
                           name, m, k_full, n, signs, w_full, plans, tws["fma"], linear, signed_block_hadamard)
            # a norm-fed layer (whole input, not the LM head) with the RMSNorm fused into its prep, as
            # BONSAI_FUSED_NORM serves gate_up: norm_ternary_linear at the decode rows
            if ranks == 1 and name != "lm_head":
                fused = linear.prepare(tws[False][0].packed, tws[False][0].scales, signs, fused_norm=True)
                if fused.fused_norm:
                    # decode rows (the fused kernel, then the layer's) and a prefill chunk (its add and norm alone)
                    for m in ([m for m in self.sz.decode_rows if m <= linear.MMA_MAX_M]
                              + [m for m in self.sz.prefill_rows if m > linear.MMA_MAX_M][:2]):
                        self.guard("linear", f"{name} M={m} fused norm", self._norm_linear_case, name, m, k_full,
                                   n, signs, w_full, fused, linear, signed_block_hadamard)
            del tws, w_full
            self.empty_cache()

    def _linear_case(self, name, m, k_full, n, signs, w_full, plans, tws, linear, signed_block_hadamard):
        from bonsai_vllm.ternary.partition import rotate_partition

        x = self.randn(m, k_full, dtype=torch.bfloat16)
        y_ref = signed_block_hadamard(x.float(), signs, 1024) @ w_full.t()
        ranks = len(tws)
        width = k_full // ranks
        self.poison_free_memory(m * n * 2)
        if ranks == 1:
            y = linear.ternary_linear(x, tws[0])
        else:
            # what each rank's adapter runs: rotate its slice (exchanging half blocks if the slice cuts one),
            # multiply; the row-parallel all-reduce then sums the ranks' outputs
            group = LocalGroup(ranks)
            slices = [x[:, r * width:(r + 1) * width] for r in range(ranks)]
            if plans[0].cut:
                xr = group.run(lambda r: rotate_partition(slices[r], tws[r].signs, plans[r], r,
                                                          lambda t: group.all_gather_last(t, r)))
                ys = [linear.ternary_linear(xr[r], tws[r], rotated=True) for r in range(ranks)]
            else:
                ys = [linear.ternary_linear(slices[r], tws[r]) for r in range(ranks)]
            y = ys[0].float() + ys[1].float()
        rt = linear.route(m, tws[0])
        bound = (3e-3 if rt.path in ("dp4a", "stream") or (rt.path == "gemv" and rt.config.variant == "fma")
                 or (rt.path == "mma" and rt.config.residual)
                 else (5e-3 if rt.path == "gemv" else 1e-2 if rt.path == "mma" else 2e-2))
        cut = ", cut block" if plans[0].cut else ""
        label = f"{name} {width}->{n}" + (f" (2 ranks{cut}, summed)" if ranks == 2 else "")
        label += f", W8 {'kept' if tws[0].w_int8 is not None else 'not kept'}" + (
            f", {rt.path}" if rt.path in ("dp4a", "mma", "stream") else "")
        self.add("linear", f"{label} M={m}", str(rt), rel_err(y, y_ref), self.bf16_bound(bound))

    def _norm_linear_case(self, name, m, k, n, signs, w_full, tw, linear, signed_block_hadamard):
        x = self.randn(m, k, dtype=torch.bfloat16)
        residual = (4 * self.randn(m, k, dtype=torch.float32)).bfloat16()
        weight = (0.1 * self.randn(k, dtype=torch.float32)).bfloat16()
        # judged on what vLLM's norm would have handed the layer (bf16 rows), as the plain cases are on x
        normed, want_res = linear.rms_norm(x, residual, weight, 1e-6, weight_offset=1.0)
        y_ref = signed_block_hadamard(normed.float(), signs, 1024) @ w_full.t()
        self.poison_free_memory(m * n * 2)
        y, new_res = linear.norm_ternary_linear(x, residual, weight, 1e-6, tw, weight_offset=1.0)
        rt = linear.route(m, tw)
        bound = (3e-3 if rt.path in ("dp4a", "stream") or (rt.path == "mma" and rt.config.residual)
                 else 1e-2 if rt.path == "mma" else 2e-2)
        same = torch.equal(new_res, want_res)
        self.add("linear", f"{name} {k}->{n}, W8 not kept, {rt.path}, RMSNorm fused ahead M={m}", str(rt),
                 rel_err(y, y_ref) if same else math.inf, self.bf16_bound(bound),
                 "" if same else "the new residual is not x + residual rounded once")

    # ------------------------------------------------------------------------------------- K3V2
    def kv(self) -> None:
        from bonsai_vllm.kv.format import K3V2
        from bonsai_vllm.kv.paged import PagedK3V2

        sz = self.sz
        fmt = K3V2.with_(head_dim=sz.head_dim)
        g = PagedK3V2(fmt, sz.block_size, sz.guard)
        g.validate()
        print(f"[{self.elapsed():.0f} s] K3V2 store", flush=True)
        self.guard("kv store", "store", self._kv_store, g)
        print(f"[{self.elapsed():.0f} s] K3V2 decode / verify rows", flush=True)
        lens = list(sz.short_lens)
        if sz.n_long:
            lo = min(8192, sz.max_model_len)
            lens += torch.randint(lo, sz.max_model_len + 1, (sz.n_long - 1,), generator=self.gen,
                                  device=self.dev).tolist() + [sz.max_model_len]
        cache, tables = self._kv_pool(g, lens)
        for b, ql in sz.decode_batches:
            self.guard("kv decode", f"B={b} QL={ql}", self._kv_decode, g, cache, tables, lens, b, ql)
        del cache, tables
        self.empty_cache()
        print(f"[{self.elapsed():.0f} s] K3V2 prefill rows", flush=True)
        for ctx, ql in sz.prefill_cases:
            self.guard("kv prefill", f"ctx={ctx} QL={ql}", self._kv_prefill, g, ctx, ql)
            self.empty_cache()

    def _kv_pool(self, g, lens: list[int]):
        """Pages for sequences of the given lengths, blocks shuffled, written as the backend writes them:
        prefill chunks of up to 2048 tokens, then the last tokens one decode step at a time."""
        bs = g.block_size
        blocks = [-(-n // bs) for n in lens]
        total = sum(blocks) + 3
        perm = torch.randperm(total, generator=self.gen, device=self.dev).int()
        cache = torch.zeros(total, self.sz.hkv, g.page_bytes, dtype=torch.uint8, device=self.dev)
        tables = []
        at = 0
        for n, nb in zip(lens, blocks):
            t = perm[at:at + nb]
            at += nb
            tables.append(t)
            pos = torch.arange(n, device=self.dev)
            slots = t.long()[pos // bs] * bs + pos % bs
            steps = min(n, 3)
            for a in range(0, n - steps, 2048):
                e = min(a + 2048, n - steps)
                g.write(cache, *self._kv_tokens(e - a), slots[a:e], use_kernels=True)
            for a in range(n - steps, n):
                g.write(cache, *self._kv_tokens(1), slots[a:a + 1], use_kernels=True)
        return cache, tables

    def _kv_tokens(self, n: int):
        """Rotated k, v [n, Hkv, D]: Gaussian (as a rotation makes them), a few outlier channels in k."""
        k = self.randn(n, self.sz.hkv, self.sz.head_dim)
        k[:, :, :2] *= 8
        return k, self.randn(n, self.sz.hkv, self.sz.head_dim)

    def _kv_store(self, g) -> None:
        sz = self.sz
        bs = g.block_size
        lens = sz.store_lens
        blocks = [-(-n // bs) for n in lens]
        total = sum(blocks) + 1
        perm = torch.randperm(total, generator=self.gen, device=self.dev).int()
        caches = [torch.full((total, sz.hkv, g.page_bytes), 255, dtype=torch.uint8, device=self.dev)
                  for _ in range(2)]
        at = 0
        for n, nb in zip(lens, blocks):
            t = perm[at:at + nb]
            at += nb
            pos = torch.arange(n, device=self.dev)
            slots = (t.long()[pos // bs] * bs + pos % bs).int()
            a, ci = 0, 0
            while a < n:  # chunks of varied sizes (prefill chunks, single decode tokens, ring wrap-around)
                e = min(n, a + sz.store_chunks[ci % len(sz.store_chunks)])
                ci += 1
                k, v = self._kv_tokens(e - a)
                s = slots[a:e].clone()
                if e - a > 8:
                    s[::11] = -1  # padded tokens: skipped
                for c, kern in zip(caches, (True, False)):
                    g.write(c, k, v, s, use_kernels=kern)
                a = e
        got, want = caches
        qb = g.quant_bytes
        bf_equal = torch.equal(got[:, :, qb:], want[:, :, qb:])
        diff = (got[:, :, :qb] != want[:, :, :qb]).float().mean().item()
        self.add("kv store", f"{len(lens)} seqs {lens}, chunks {sz.store_chunks}", "triton store + torch ring",
                 diff if bf_equal else math.inf, 1e-3,
                 "fraction of packed bytes differing (codes on a rounding edge); bf16 area bit-identical"
                 if bf_equal else "bf16 sinks/ring differ")

    def _kv_decode(self, g, cache, tables, lens, b: int, ql: int) -> None:
        from bonsai_vllm.kv.kernels.decode import auto_splits

        sz = self.sz
        # b sequences long enough for ql queries: the longest always in, the rest drawn at random
        cand = [i for i, n in enumerate(lens) if n >= ql + 1]
        if len(cand) < b:
            raise ValueError(f"the pool has {len(cand)} sequences of more than {ql} tokens, {b} asked for")
        longest = max(cand, key=lambda i: lens[i])
        others = [i for i in cand if i != longest]
        pick = torch.randperm(len(others), generator=self.gen, device=self.dev)[:b - 1].tolist()
        rows = [longest] + [others[i] for i in pick]
        table = torch.zeros(b, max(len(tables[i]) for i in rows), dtype=torch.int32, device=self.dev)
        for j, i in enumerate(rows):
            table[j, :len(tables[i])] = tables[i]
        seq = torch.tensor([lens[i] for i in rows], dtype=torch.int32, device=self.dev)
        q = self.randn(b, ql, sz.hq, sz.head_dim)
        scale = sz.head_dim ** -0.5
        splits = auto_splits(max(lens[i] for i in rows), b, sz.hkv)  # as adapters/k3v2_attention.py
        out = torch.full((b, ql, sz.hq, sz.head_dim), float("nan"), device=self.dev)
        got = g.decode(q, cache, table, seq, scale, use_kernels=True, num_splits=splits, out=out)
        want = g.decode(q, cache, table, seq, scale, use_kernels=False)
        ctx = sorted(lens[i] for i in rows)
        self.add("kv decode", f"B={b} QL={ql} ctx {ctx[0]}..{ctx[-1]}", f"grouped decode, {splits} splits",
                 rel_err(got, want), 2e-3)

    def _kv_prefill(self, g, ctx: int, ql: int) -> None:
        sz = self.sz
        n = ctx + ql
        bs = g.block_size
        nb = -(-n // bs)
        cache = torch.zeros(nb + 1, sz.hkv, g.page_bytes, dtype=torch.uint8, device=self.dev)
        table = torch.randperm(nb + 1, generator=self.gen, device=self.dev).int()[:nb]
        pos = torch.arange(n, device=self.dev)
        slots = table.long()[pos // bs] * bs + pos % bs
        own = None
        for a in range(0, n, 8192):  # the context, then the row itself (the backend writes before attention)
            e = min(n, a + 8192)
            k, v = self._kv_tokens(e - a)
            g.write(cache, k, v, slots[a:e], use_kernels=True)
            if e > ctx:
                own = (k[max(0, ctx - a):], v[max(0, ctx - a):]) if own is None else \
                    (torch.cat([own[0], k[max(0, ctx - a):]]), torch.cat([own[1], v[max(0, ctx - a):]]))
        q = self.randn(ql, sz.hq, sz.head_dim)
        scale = sz.head_dim ** -0.5
        self.poison_free_memory(ql * sz.hq * sz.head_dim * 4 * 4)
        got = g.prefill_row(q, own[0], own[1], cache, table, n, scale, use_kernels=True)
        want = g.prefill_row(q, own[0], own[1], cache, table, n, scale, use_kernels=False)
        route = "decode kernel, sub-rows" + (" (window from the ring)" if ql <= g.window else "")
        self.add("kv prefill", f"ctx={ctx} QL={ql}", route, rel_err(got, want), 2e-3)

    # ------------------------------------------------------------------------------------- all-reduce
    def allreduce(self) -> None:
        from bonsai_vllm.comm.reference import error_bound
        from bonsai_vllm.comm import kernels as allreduce

        print(f"[{self.elapsed():.0f} s] all-reduce", flush=True)
        min_rows = 128  # BONSAI_AR_INT8_MIN_TOKENS' default (adapters/allreduce.py)
        for m in self.sz.allreduce_rows:
            self.guard("allreduce", f"{m}x{self.sz.hidden}", self._allreduce_case, m, min_rows, allreduce,
                       error_bound)

    def _allreduce_case(self, m, min_rows, allreduce, error_bound) -> None:
        parts = [self.randn(m, self.sz.hidden, dtype=torch.bfloat16) for _ in range(2)]
        exact = parts[0].float() + parts[1].float()
        group = LocalGroup(2)

        def rank(r: int) -> torch.Tensor:
            return allreduce.tp_all_reduce(parts[r], lambda buf: group.gather_bytes(buf, r),
                                           lambda t: group.all_reduce_sum(t, r), min_rows)

        self.poison_free_memory(m * self.sz.hidden * 8)
        ys = group.run(rank)
        rt = allreduce.route(parts[0], min_rows)
        same = torch.equal(ys[0], ys[1])
        if rt == allreduce.ROUTE_BF16:
            err, bound = rel_err(ys[0], exact), 4e-3  # one bf16 rounding of the sum
        else:  # every element within the stated bound (plus the bf16 rounding of the output)
            eb = error_bound(parts)  # int8 steps; then the output's bf16 rounding (half an ulp: 2^-8 relative)
            excess = (ys[0].float() - exact).abs() - eb - (exact.abs() + eb) * self.bf16_bound(2 ** -8)
            err, bound = max(0.0, excess.max().item()), 0.0
        self.add("allreduce", f"{m}x{self.sz.hidden}, 2 ranks", rt, err if same else math.inf, bound,
                 "" if same else "the ranks' results differ")

    # ------------------------------------------------------------------------------------- Hadamard
    def hadamard(self) -> None:
        from bonsai_vllm.ternary.reference import signed_block_hadamard
        from bonsai_vllm.ternary.kernels import hadamard

        print(f"[{self.elapsed():.0f} s] Hadamard", flush=True)
        for k in self.sz.hadamard_widths:
            signs = torch.randint(0, 2, (k,), generator=self.gen, device=self.dev).float() * 2 - 1
            for m in self.sz.hadamard_rows:
                x = self.randn(m, k, dtype=torch.bfloat16)
                ref = signed_block_hadamard(x.float(), signs, 1024)
                out = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device=self.dev)
                self.add("hadamard", f"block_hadamard {m}x{k}", "rotation kernel",
                         rel_err(hadamard.block_hadamard(x, signs, 1024, out=out), ref), self.bf16_bound(3e-3))
                out = torch.full((m, k), float("nan"), dtype=torch.float32, device=self.dev)
                self.add("hadamard", f"block_hadamard -> x' {m}x{k}", "rotation kernel, GEMV order",
                         rel_err(hadamard.block_hadamard(x, signs, 1024, gemv_order=True, out=out),
                                 hadamard.gemv_order_ref(ref)), 1e-5)
                q, ts = hadamard.quantize_per_token(x, signs)
                q_ref, ts_ref = hadamard.quantize_per_token_ref(ref)
                d = (q.int() - q_ref.int()).abs()
                self.add("hadamard", f"rotate+quantize {m}x{k}", "fused rotate + int8",
                         math.inf if d.max() > 1 else (d > 0).float().mean().item(), 1e-3,
                         f"scales rel {rel_err(ts, ts_ref):.1e}")
        # the CUDA C rotation + prep of decode rows (rotate_prep.cu): bit for bit its reference's bytes, sums
        # and scales, in every output buffer (NaN / -7 poisoned first), at the rows and rows per CTA it serves
        from bonsai_vllm.ternary.kernels import dp4a, rotate_prep

        if not rotate_prep.applies(self.dev, 1024):
            print("  rotate_prep: not on this device (CUDA, sm_90 and later)", flush=True)
            return
        for k in self.sz.hadamard_widths:
            signs = torch.randint(0, 2, (k,), generator=self.gen, device=self.dev).float() * 2 - 1
            for m in self.sz.rotate_prep_rows:
                for dtype in (torch.bfloat16, torch.float32):
                    x = self.randn(m, k, dtype=dtype)
                    want = rotate_prep.rotate_prep_reference(x, signs, 1024)
                    for rows in rotate_prep.ROWS_PER_CTA:
                        self.guard("hadamard", f"rotate_prep {m}x{k} {dtype} R={rows}", self._rotate_prep_case, x,
                                   signs, want, rows, rotate_prep, dp4a)
        # the residual add + RMSNorm fused ahead of the same rotation + prep (norm_rotate_prep, BONSAI_FUSED_NORM):
        # the new residual, the normed rows and the activations bit for bit, at the model's hidden width, with and
        # without a residual; the add and norm alone (a CTA per row) also with the residual updated in place
        k = self.sz.hidden
        if not rotate_prep.norm_applies(self.dev, k, 1024):
            print(f"  norm_rotate_prep: K = {k} is not whole 1024-blocks up to {rotate_prep.NORM_MAX_K}", flush=True)
            return
        signs = torch.randint(0, 2, (k,), generator=self.gen, device=self.dev).float() * 2 - 1
        for m in self.sz.rotate_prep_rows:
            for dtype in (torch.bfloat16, torch.float16):
                weight = (0.1 * self.randn(k, dtype=torch.float32)).to(dtype)  # Gemma-style: times 1 + weight
                x = self.randn(m, k, dtype=dtype)
                residual = (4 * self.randn(m, k, dtype=torch.float32)).to(dtype)
                for mode in ("residual", "in place", "no residual", "norm only"):
                    self.guard("hadamard", f"norm_rotate_prep {m}x{k} {dtype} {mode}", self._norm_prep_case, x,
                               residual, weight, signs, mode, rotate_prep, dp4a)

    def _rotate_prep_case(self, x, signs, want, rows, rotate_prep, dp4a) -> None:
        m, k = x.shape
        out = dp4a.empty_activations(k, x.device, m)
        for t in (out.xa, out.xr, out.gx, out.gr):
            t.fill_(-7)
        out.s.fill_(float("nan"))
        got = rotate_prep.rotate_prep(x, signs, 1024, out=out, rows_per_cta=rows)
        fields = ("xa", "xr", "gx", "gr", "s")
        differ = sum(int((getattr(got, f) != getattr(want, f)).sum()) for f in fields)
        total = sum(getattr(want, f).numel() for f in fields)
        self.add("hadamard", f"rotate_prep {m}x{k} {str(x.dtype).removeprefix('torch.')} R={rows}",
                 "CUDA C rotation + prep", differ / total, 0.0, "fraction of elements not bit-equal to the reference")

    def _norm_prep_case(self, x, residual, weight, signs, mode, rotate_prep, dp4a) -> None:
        m, k = x.shape
        eps = 1e-6
        res_in = None if mode == "no residual" else residual.clone()
        want_normed, want_res, want = rotate_prep.norm_rotate_prep_reference(x, res_in, weight, eps, signs, 1024,
                                                                             weight_offset=1.0)
        out = dp4a.empty_activations(k, x.device, m)
        for t in (out.xa, out.xr, out.gx, out.gr):
            t.fill_(-7)
        out.s.fill_(float("nan"))
        res_out = None
        if mode in ("residual", "norm only"):
            res_out = torch.full_like(x, float("nan"))
        elif mode == "in place":
            res_out = res_in
        # the add and norm alone: the instance for rows on the other routes (the only one that may update the
        # residual in place: the prep's CTAs each read the whole row)
        prep = mode not in ("norm only", "in place")
        normed, new_res, got = rotate_prep.norm_rotate_prep(x, res_in, weight, eps, signs, 1024, weight_offset=1.0,
                                                            residual_out=res_out, out=out if prep else None,
                                                            prep=prep)
        fields = ("xa", "xr", "gx", "gr", "s") if prep else ()
        differ = sum(int((getattr(got, f) != getattr(want, f)).sum()) for f in fields)
        total = sum(getattr(want, f).numel() for f in fields)
        differ += int((normed != want_normed).sum())
        total += normed.numel()
        if want_res is not None:
            differ += int((new_res != want_res).sum())
            total += new_res.numel()
        # beside it, what vLLM's GemmaRMSNorm computes (linear.rms_norm): one rounding apart at most
        from bonsai_vllm.ternary.kernels.linear import rms_norm

        vllm, _ = rms_norm(x, None if res_in is None else residual, weight, eps, weight_offset=1.0)
        off = (normed != vllm).float().mean().item()
        self.add("hadamard", f"norm_rotate_prep {m}x{k} {str(x.dtype).removeprefix('torch.')} {mode}",
                 "CUDA C add + RMSNorm + rotation + prep", differ / total, 0.0,
                 f"fraction not bit-equal to the reference; normed rows unequal to vLLM's norm: {off:.1e}")

    # ------------------------------------------------------------------------------------- embeddings
    def embeddings(self) -> None:
        from bonsai_vllm import embeddings as emb

        sz = self.sz
        print(f"[{self.elapsed():.0f} s] SSD embeddings ({sz.vocab} x {sz.hidden} bf16 export)", flush=True)
        table = self.randn(sz.vocab, sz.hidden, dtype=torch.bfloat16).cpu()
        with tempfile.TemporaryDirectory(prefix="gpu-check-embed-") as d:
            emb.export_embedding_table(table, Path(d), tensor_name="model.embed_tokens.weight",
                                       hot_size=sz.hot_vocab)
            meta, mapped = emb.open_table(Path(d))
            rows = sz.vocab // 2  # one TP=2 rank's shard
            for r in range(2):
                plan = emb.plan_shard(meta.hot_ids, sz.hot_vocab, start=r * rows, rows=rows, padded_rows=rows)
                hot = emb.build_hot_table(mapped, plan).to(self.dev)
                slot_of = plan.slot_of.to(self.dev)
                cold = emb.ColdRows(mapped, plan)
                dense = table[r * rows:(r + 1) * rows].to(self.dev)
                for n in sz.embed_batches:
                    ids = torch.randint(0, rows, (n,), generator=self.gen, device=self.dev)
                    ids[: max(1, n // 4)] = plan.hot_ids[:max(1, n // 4)].to(self.dev) - r * rows  # hot ones too
                    before = cold.reads
                    got = emb.lookup(ids, hot, slot_of, cold)
                    n_cold = int((plan.slot_of[ids.cpu()] < 0).sum())
                    self.add("embeddings", f"rank {r} lookup of {n} ids", f"{n - n_cold} hot, {n_cold} cold "
                             f"({cold.reads - before} rows read from the file)",
                             0.0 if torch.equal(got, dense[ids]) else math.inf, 0.0, "bit-identical to the table")
                    dev_only = emb.lookup_device_only(ids, hot, slot_of, plan.zero_slot)
                    is_hot = (slot_of[ids] >= 0)[:, None]
                    ok = torch.equal(torch.where(is_hot, dev_only, 0), torch.where(is_hot, dense[ids], 0)) and \
                        bool((dev_only[~is_hot[:, 0]] == 0).all())
                    self.add("embeddings", f"rank {r} drafter lookup of {n} ids", "device table only",
                             0.0 if ok else math.inf, 0.0, "hot rows exact, cold rows zero")
                del hot, dense
            del mapped

    # ------------------------------------------------------------------------------------- report
    def bf16_bound(self, bound: float) -> float:
        """Triton's interpreter rounds float32 -> bf16 by truncation (twice the error of the GPU's
        round-to-nearest), so the smoke run doubles the bounds of bf16 outputs."""
        return 2 * bound if self.dev == "cpu" else bound

    def elapsed(self) -> float:
        return time.time() - self.t0

    def empty_cache(self) -> None:
        if self.dev == "cuda":
            torch.cuda.empty_cache()

    def table(self) -> str:
        """Markdown: every non-linear case on its own row; linear cases one row per (layer, route) with the
        row counts they cover and the worst error."""
        lines = ["| section | case | route | error | bound | pass |", "|---|---|---|---|---|---|"]
        groups: dict[tuple, list[Case]] = {}
        for c in self.cases:
            if c.section == "linear" and c.route != "raised":
                layer, _, m = c.name.rpartition(" M=")
                groups.setdefault((layer, c.route), []).append((int(m), c))
                continue
            lines.append(f"| {c.section} | {c.name} | {c.route} | {c.error:.2e} | {c.bound:.0e} | "
                         f"{'ok' if c.ok else '**FAIL**'} |")
        lin = []
        for (layer, rt), items in groups.items():
            ms = sorted(m for m, _ in items)
            worst = max((c for _, c in items), key=lambda c: c.error / max(c.bound, 1e-30))
            ok = all(c.ok for _, c in items)
            lin.append(f"| linear | {layer} M={_ranges(ms)} ({len(ms)} cases) | {rt} | {worst.error:.2e} | "
                       f"{worst.bound:.0e} | {'ok' if ok else '**FAIL**'} |")
        return "\n".join(lines[:2] + lin + lines[2:])


def _ranges(ms: list[int]) -> str:
    out, start, prev = [], ms[0], ms[0]
    for m in ms[1:] + [None]:
        if m is not None and m == prev + 1:
            prev = m
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if m is not None:
            start = prev = m
    return ",".join(out)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64; inf where a holds a NaN (poison left unwritten) or an inf."""
    if not torch.isfinite(a).all():
        return math.inf
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class LocalGroup:
    """Tensor-parallel ranks on one device, for entry points that call collectives (an all-gather, an
    all-reduce). The ranks run one after another, twice: the first pass records what each rank contributes
    to each of its collectives, in call order (and gets its own contribution back in every slot); the
    second answers each collective with every rank's recorded contribution, as NCCL would. The entry points
    are deterministic, so the second pass contributes the same tensors (checked). No threads: Triton's
    interpreter is not thread-safe, and on a GPU one rank's kernels run one at a time on its stream."""

    def __init__(self, world: int):
        self.world = world
        self.record: list[list[torch.Tensor]] = [[] for _ in range(world)]
        self.second = False
        self.calls = [0] * world

    def _exchange(self, t: torch.Tensor, rank: int) -> list[torch.Tensor]:
        if not self.second:
            self.record[rank].append(t.clone())
            return [t] * self.world
        i = self.calls[rank]
        self.calls[rank] += 1
        if not torch.equal(self.record[rank][i], t):
            raise RuntimeError(f"rank {rank}'s contribution to collective {i} changed between passes")
        return [self.record[r][i] for r in range(self.world)]

    def all_gather_last(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        return torch.cat(self._exchange(t, rank), dim=-1)

    def gather_bytes(self, buf: torch.Tensor, rank: int) -> torch.Tensor:
        return torch.stack(self._exchange(buf, rank))

    def all_reduce_sum(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        return sum(p.float() for p in self._exchange(t, rank)).to(t.dtype)

    def run(self, fn) -> list:
        for r in range(self.world):
            fn(r)
        self.second = True
        return [fn(r) for r in range(self.world)]


SECTIONS = ("linear", "kv", "allreduce", "hadamard", "embeddings")


def run(device: str, sizes: Sizes, seed: int, only: tuple[str, ...] = SECTIONS) -> Checker:
    ck = Checker(device, sizes, seed)
    for s in only:
        getattr(ck, s)()
    return ck


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ".cache/gpu-check"))
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU through Triton's interpreter")
    args = ap.parse_args(argv)
    only = tuple(s for s in args.only.split(",") if s)
    if bad := set(only) - set(SECTIONS):
        ap.error(f"unknown sections {sorted(bad)}; choose from {SECTIONS}")
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--smoke needs TRITON_INTERPRET=1 in the environment (set before Triton is imported)")
        device, sizes = "cpu", smoke_sizes()
    elif not torch.cuda.is_available():
        print("gpu-check needs a CUDA GPU (the CPU tests run the kernels through Triton's interpreter; "
              "--smoke runs this script that way at toy sizes)")
        return 2
    else:
        device, sizes = "cuda", Sizes()
    import triton

    header = (f"gpu-check {time.strftime('%Y-%m-%d %H:%M')}, seed {args.seed}, "
              f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU (interpreter)'}, torch {torch.__version__}, "
              f"triton {triton.__version__}")
    print(header, flush=True)
    ck = run(device, sizes, args.seed, only)
    md = ck.table()
    failed = [c for c in ck.cases if not c.ok]
    summary = f"{len(ck.cases)} cases, {len(failed)} failed, {ck.elapsed():.0f} s"
    print("\n" + md + "\n\n" + summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.md").write_text(f"{header}\n\n{md}\n\n{summary}\n")
    (out / "gpu-check.json").write_text(json.dumps({"header": header, "seed": args.seed,
                                                    "cases": [asdict(c) for c in ck.cases]}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
