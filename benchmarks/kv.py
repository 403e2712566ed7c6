"""Check, then time, the K3V2 KV-cache kernels at the 27B's shapes (`make bench-kv`; needs a CUDA GPU).

    PYTHONPATH=plugin python -m benchmarks.kv [--out DIR] [--budget-s 300] [--no-sweep]

One run:
1. checks on fresh random data at real shapes (24 query / 4 KV heads and the TP=2 rank's 12 / 2,
   head_dim 256, 8k tokens of context + sinks + window, outputs poisoned first):
   - store kernel against reference.store_ref (bytes; codes may differ by one at rounding ties);
   - the served decode kernel (`bonsai_vllm.kv.kernels.decode.decode`) against reference.decode_ref,
     grouped and one program per query head (heads_per_program=1, the baseline), K3V2 and K2V2, 1 and 2
     query positions (MTP verify rows), then every launch configuration the sweep times;
   - the GQA trap: a head tile of 8 over groups of 6 must be caught by the same comparison;
   - the whole layer (LayerKVCache, kernels) against the same layer on the reference, with flushes;
   a failed check is printed and makes the exit status 1; a configuration that fails is not timed;
2. measures device-to-device copy bandwidth (bytes read + written): the ceiling for streaming the cache;
3. sweeps the served kernel's launch knobs at 80k tokens (full model shape, grouped, then per-head):
   DecodeConfig's block_n / warps / stages and the programs auto_splits aims the split count at; keeps
   the fastest of each;
4. times decode attention of one full-attention layer at 8k / 32k / 80k tokens of context for both
   shapes: K3V2 grouped, K3V2 one program per query head, bf16 SDPA (PyTorch, GQA), and the floor
   (compressed bytes / copy bandwidth), as CUDA-graph replays over enough cache copies that the
   timed reads do not come from L2;
5. prints one table and writes bench-kv.md / bench-kv.json to --out (default $OUT or .).

The other unpackings ("cvt", "bits") and per-piece product chains (ILP) were measured against the served
kernel and dropped (docs/kv-cache.md has the figures); only the served kernel is checked and timed.

`--prefill` instead checks and times prefill rows (`PagedK3V2.prefill_row`, one TP=2 rank's 12 / 2 heads,
the 27B's served block of 2176): the decode-kernel route against the chunked torch route at D = 256, then both
routes' time and peak extra memory beside bf16 SDPA (flash, no mask) over the same shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.kernels import time_eager, time_graph
from bonsai_vllm.kv import reference as ref
from bonsai_vllm.kv.format import K2V2, K3V2, KVFormat
from bonsai_vllm.kv.kernels.decode import DecodeConfig

D = 256
SHAPES = {"full": (24, 4), "rank": (12, 2)}  # (query heads, KV heads): whole model, one TP=2 rank
CONTEXTS = [8192, 32768, 81920]
BLOCK_SIZE = 2048  # page size in tokens for the bench (vLLM's hybrid alignment gives 2464; any works)
SM_SCALE = D ** -0.5
L2_BYTES = 60 << 20  # H200 (KINDS.md)

FAILURES: list[str] = []
CFG_OK: dict[DecodeConfig, bool] = {}  # what compiles and is checked (the split target only changes the grid)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One decode configuration of the sweep: the served kernel's launch knobs and the programs
    decode.auto_splits aims the split count at (264: one wave of 2 per SM on the H200)."""

    config: DecodeConfig = dataclasses.field(default_factory=DecodeConfig)  # block_n, block_w, warps, stages
    target: int = 264

    def to_dict(self) -> dict:
        """Flat, as bench-kv.json records it (and `from_dict` reads it back)."""
        return dict(dataclasses.asdict(self.config), target=self.target)

    @classmethod
    def from_dict(cls, d: dict) -> Candidate:
        """Also the older files, whose `unpack` / `ilp` (of kernel variants since dropped) are ignored."""
        names = {f.name for f in dataclasses.fields(DecodeConfig)}
        return cls(DecodeConfig(**{k: v for k, v in d.items() if k in names}), target=d.get("target", 264))

    def __str__(self) -> str:
        c = self.config
        return f"block_n={c.block_n} block_w={c.block_w} warps={c.warps} stages={c.stages} target={self.target}"


LOG: list[str] = []
T0 = time.time()


def say(*a) -> None:
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


def check(name: str, ok: bool, detail: str) -> bool:
    if not ok:
        FAILURES.append(f"{name}: {detail}")
    say(f"  check {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    return ok


def elapsed() -> float:
    return time.time() - T0


# ----------------------------------------------------------------------------------------- fixtures

class Ctx:
    """`copies` independent caches of one context length (so timed loops stream from HBM, not L2)."""

    def __init__(self, fmt: KVFormat, hq: int, hkv: int, ctx: int, copies: int, ql: int = 1, seed: int = 0,
                 dev: str = "cuda"):
        from bonsai_vllm.kv.kernels.store import store

        g = torch.Generator(device=dev).manual_seed(seed)
        self.fmt, self.hq, self.hkv, self.ql = fmt, hq, hkv, ql
        self.nw = fmt.sink + fmt.window
        self.nq = ctx - self.nw
        nb = -(-self.nq // BLOCK_SIZE)
        self.cache = ref.new_cache(fmt, nb * copies, BLOCK_SIZE, hkv, dev)
        # pages in a shuffled order (one permutation, shifted by nb per copy, so a byte copy of copy 0's
        # pages is a valid copy c); copy 0 filled with random rotated K/V (Gaussian, as a rotation makes
        # them) through the store kernel
        perm = torch.randperm(nb, generator=g, device=dev).to(torch.int32)
        self.tables = [(perm + c * nb)[None, :].contiguous() for c in range(copies)]
        t = torch.arange(self.nq, device=dev)
        slots_all = (perm.long()[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE).to(torch.int32)
        step = 16384
        for t0 in range(0, self.nq, step):
            n = min(step, self.nq - t0)
            k = torch.randn(n, hkv, D, generator=g, device=dev)
            v = torch.randn(n, hkv, D, generator=g, device=dev)
            store(self.cache, k, v, slots_all[t0:t0 + n], fmt, BLOCK_SIZE)
        for c in range(1, copies):
            self.cache[c * nb:(c + 1) * nb] = self.cache[:nb]
        self.n_quant = torch.tensor([self.nq], dtype=torch.int32, device=dev)
        self.n_win = torch.tensor([self.nw], dtype=torch.int32, device=dev)
        self.win_k = [torch.randn(1, hkv, self.nw, D, generator=g, device=dev).bfloat16() for _ in range(copies)]
        self.win_v = [torch.randn(1, hkv, self.nw, D, generator=g, device=dev).bfloat16() for _ in range(copies)]
        self.q = [torch.randn(1, ql, hq, D, generator=g, device=dev) for _ in range(copies)]
        self.copies = copies

    def bytes(self) -> int:
        """Compressed bytes one decode must read: pages + the bf16 part (+ q and output, negligible)."""
        return self.nq * self.hkv * self.fmt.slot_bytes + self.nw * self.hkv * 2 * D * 2

    def args(self, c: int):
        return (self.q[c], self.cache, self.tables[c], self.n_quant, self.win_k[c], self.win_v[c], self.n_win,
                self.fmt, BLOCK_SIZE, SM_SCALE)


def copies_for(nbytes: int) -> int:
    return max(2, math.ceil(3 * L2_BYTES / max(1, nbytes)))


def graph_time(fns, reps: int = 7) -> float:
    """Median µs per call of fns (run in order) captured in one CUDA graph: bench_kernels.time_graph with
    each call its own buffer set."""
    return time_graph(lambda i: fns[i](), copies=len(fns), calls=len(fns), reps=reps)


def calls(n: int, copies: int) -> list[int]:
    reps = max(copies, 24)
    return [i % copies for i in range(reps)]


# ------------------------------------------------------------------------------------------- checks

def check_store(dev: str, t: int = 4096) -> None:
    from bonsai_vllm.kv.kernels.store import store

    say("store kernel vs reference.store_ref")
    for fmt in (K3V2, K2V2):
        hkv, nb = 4, max(1, -(-2 * t // BLOCK_SIZE))
        g = torch.Generator(device=dev).manual_seed(1)
        k = torch.randn(t, hkv, D, generator=g, device=dev).bfloat16()
        v = (torch.randn(t, hkv, D, generator=g, device=dev) * 3).bfloat16()
        k[:, :, :4] *= 20  # outlier channels
        slots = torch.randperm(nb * BLOCK_SIZE, generator=g, device=dev)[:t].to(torch.int32)
        slots[::97] = -1
        c_ref = ref.new_cache(fmt, nb, BLOCK_SIZE, hkv, dev)
        c_ker = c_ref.clone()
        ref.store_ref(c_ref, k.float(), v.float(), slots, fmt, BLOCK_SIZE)
        store(c_ker, k, v, slots, fmt, BLOCK_SIZE)
        keep = slots >= 0
        a = ref.gather_ref(c_ref, torch.arange(nb, device=dev), nb * BLOCK_SIZE, fmt, BLOCK_SIZE)
        b = ref.gather_ref(c_ker, torch.arange(nb, device=dev), nb * BLOCK_SIZE, fmt, BLOCK_SIZE)
        sl = slots[keep].long()
        meta_eq = torch.equal(a["meta"][sl].view(torch.int16), b["meta"][sl].view(torch.int16))
        kd_ref, vd_ref = ref.decode_slots({n: x[sl] for n, x in a.items()}, fmt)
        kd, vd = ref.decode_slots({n: x[sl] for n, x in b.items()}, fmt)
        kq_ref = ref.unpack_2bit(a["k_lo"][sl]).int()
        kq = ref.unpack_2bit(b["k_lo"][sl]).int()
        diff = (kq - kq_ref).abs()
        frac = (diff > 0).float().mean().item()
        written = torch.zeros(nb * BLOCK_SIZE, dtype=torch.bool, device=dev)
        written[sl] = True
        untouched = all(bool((x[~written].view(torch.uint8) == 255).all()) for x in b.values())
        check(f"store {fmt.name}", meta_eq and frac < 1e-4 and diff.max().item() <= 1 and untouched,
              f"scale/min bit-equal {meta_eq}, codes differing {frac:.1e} (max {diff.max().item()}), "
              f"dequant rel diff K {ref.rel_err(kd, kd_ref):.1e} V {ref.rel_err(vd, vd_ref):.1e}, "
              f"skipped slots untouched {untouched}")


def check_decode(dev: str, ctx: int = 8192) -> None:
    from bonsai_vllm.kv.kernels.decode import decode

    say("decode kernel vs reference.decode_ref (8k tokens + sinks + window)")
    cases = [(K3V2, shape, ql, True) for shape in ("full", "rank") for ql in (1, 2)]
    cases += [(K3V2, "full", 1, False), (K3V2, "rank", 2, False), (K2V2, "full", 1, True), (K2V2, "rank", 2, True)]
    for fmt, shape, ql, grouped in cases:
        hq, hkv = SHAPES[shape]
        cx = Ctx(fmt, hq, hkv, ctx, 1, ql=ql, seed=100 * ql + 10 * fmt.k_bits + hkv + (0 if grouped else 1), dev=dev)
        want = ref.decode_ref(*cx.args(0))
        out = torch.full_like(want, float("nan"))
        try:
            decode(*cx.args(0), heads_per_program=None if grouped else 1, num_splits=7, out=out)
            err = ref.rel_err(out, want)
        except Exception as e:  # reported as a failed check, not fatal: the other checks still run
            err = math.inf
            say(f"    {type(e).__name__}: {str(e)[:200]}")
        check(f"decode {fmt.name} {shape} QL={ql} {'grouped' if grouped else 'per-head'}", err < 2e-3,
              f"rel err {err:.2e} (tol 2e-3)")
    # the GQA trap: tiles of 8 heads over groups of 6 read the wrong KV head for some rows
    cx = Ctx(K3V2, 24, 4, ctx, 1, seed=5, dev=dev)
    want = ref.decode_ref(*cx.args(0))
    # every configuration the sweep will time, on the same data (tile shapes, warps, stages)
    for cand in SWEEP + PER_HEAD_SWEEP:
        cfg = cand.config
        if cfg in CFG_OK:
            continue
        try:
            out = decode(*cx.args(0), config=cfg, num_splits=7)
            err = ref.rel_err(out, want)
        except Exception as e:  # a configuration that does not compile on this Triton is reported, not timed
            err = math.inf
            say(f"    {type(e).__name__}: {str(e)[:200]}")
        CFG_OK[cfg] = check(f"decode config {cfg}", err < 2e-3, f"rel err {err:.2e}")
    bad = decode(*cx.args(0), heads_per_program=8, _unsafe=True, num_splits=7)
    err = ref.rel_err(bad, want)
    check("GQA trap (head tile 8 over group 6) is caught", err > 0.05, f"rel err {err:.2f} (must be > 0.05)")


def check_layer(dev: str, n0: int = 3000, steps: int = 70) -> None:
    """The whole layer with kernels against the same layer on the reference: prefill + decode steps
    with flushes, window, sinks, then verify rows (QL = 2)."""
    from bonsai_vllm.kv.cache import LayerKVCache
    from bonsai_vllm.kv.rotation import KVRotation

    say("layer (store + decode kernels) vs layer on the reference")
    hq, hkv = 24, 4
    rot = KVRotation.randomized_hadamard(3, hkv, D)
    g = torch.Generator(device=dev).manual_seed(7)
    lk = LayerKVCache(K3V2, rot, hkv, 256, 64, 2, device=dev, use_kernels=True)
    lr = LayerKVCache(K3V2, rot, hkv, 256, 64, 2, device=dev, use_kernels=False)
    worst = 0.0
    for b, n in ((0, n0), (1, n0 // 4)):
        k = torch.randn(n, hkv, D, generator=g, device=dev).bfloat16()
        v = torch.randn(n, hkv, D, generator=g, device=dev).bfloat16()
        lk.append(b, k, v)
        lr.append(b, k, v)
    for step in range(steps):  # 70 steps cross a flush (window 128, flush 64)
        for b in range(2):
            k = torch.randn(1, hkv, D, generator=g, device=dev).bfloat16()
            v = torch.randn(1, hkv, D, generator=g, device=dev).bfloat16()
            lk.append(b, k, v)
            lr.append(b, k, v)
        if step % 23 == 0 or step == steps - 1:
            q = torch.randn(2, 1, hq, D, generator=g, device=dev).bfloat16()
            worst = max(worst, ref.rel_err(lk.attend(q, SM_SCALE), lr.attend(q, SM_SCALE)))
    for b in range(2):
        k = torch.randn(2, hkv, D, generator=g, device=dev).bfloat16()
        lk.append(b, k, k)
        lr.append(b, k, k)
    q = torch.randn(2, 2, hq, D, generator=g, device=dev).bfloat16()
    worst = max(worst, ref.rel_err(lk.attend(q, SM_SCALE), lr.attend(q, SM_SCALE)))
    check("layer kernels vs reference (3 flushes, verify rows)", worst < 3e-3, f"worst rel err {worst:.2e}")


# --------------------------------------------------------------------------------------------- timing

def copy_bandwidth(dev: str) -> dict:
    """Device copy bandwidth, bytes read + written per second, three ways; the best is the ceiling.

    Run 1 measured copy_ captured in a CUDA graph at 2.71 TB/s: a graph turns the device-to-device
    copy into a memcpy node, which may go to the copy engines; the kernels we compare against run on the
    SMs, so an SM copy kernel (mul by 1 into another buffer) is measured too, and copy_ eagerly."""
    import triton.testing

    n = 1 << 30
    a = torch.randn(n // 4, device=dev)
    b = torch.empty_like(a)
    out = {"copy_graph": 2 * n / (graph_time([lambda: b.copy_(a)] * 8) * 1e-6),
           "sm_kernel_graph": 2 * n / (graph_time([lambda: torch.mul(a, 1.0, out=b)] * 8) * 1e-6),
           "copy_do_bench": 2 * n / (triton.testing.do_bench(lambda: b.copy_(a), warmup=25, rep=200,
                                                             return_mode="median") * 1e-3)}
    return out


def time_decode(cx: Ctx, grouped: bool, cand: Candidate, splits: int | None = None) -> float:
    from bonsai_vllm.kv.kernels.decode import auto_splits, decode

    # programs per split: one per KV head (grouped) or one per query head
    s = splits or auto_splits(cx.nq, 1, cx.hkv if grouped else cx.hq, cand.config.tile(BLOCK_SIZE),
                              target_programs=cand.target)
    fns = [(lambda c=c: decode(*cx.args(c), config=cand.config, heads_per_program=None if grouped else 1,
                               num_splits=s))
           for c in calls(0, cx.copies)]
    return graph_time(fns)


def time_sdpa(hq: int, hkv: int, ctx: int, ql: int, dev: str) -> float:
    per = ctx * hkv * D * 2 * 2
    copies = copies_for(per)
    g = torch.Generator(device=dev).manual_seed(3)
    ks = [torch.randn(1, hkv, ctx, D, generator=g, device=dev).bfloat16() for _ in range(copies)]
    vs = [torch.randn(1, hkv, ctx, D, generator=g, device=dev).bfloat16() for _ in range(copies)]
    q = torch.randn(1, hq, ql, D, generator=g, device=dev).bfloat16()
    fns = [(lambda c=c: F.scaled_dot_product_attention(q, ks[c], vs[c], enable_gqa=True)) for c in calls(0, copies)]
    return graph_time(fns)


# Candidates: DecodeConfig's block_n / warps / stages (stages None: Triton's default) and the target programs
# of decode.auto_splits (since run 2 counting the bf16 part's program too). Run 2 (2026-11-29, H200, Triton
# 3.6) at 80k, full shape, as (block_n, warps, stages, target): (128,4,2,264) 53.0 µs best (now the served
# default); (128,4,None,264) 56.5; (128,4,None,528) 62.8; BLOCK_N 64: 69.8-75.9. The variants it also timed
# (ILP 62.9, unpack 0 104.7) were dropped from the bench (docs/kv-cache.md).
def _candidate(block_n: int, warps: int, stages: int | None, target: int) -> Candidate:
    return Candidate(DecodeConfig(block_n=block_n, warps=warps, stages=stages), target=target)


SWEEP = [
    _candidate(block_n=128, warps=4, stages=2, target=264),  # run 2's best (the served default)
    _candidate(block_n=128, warps=4, stages=None, target=264),
    _candidate(block_n=128, warps=4, stages=2, target=528),
    _candidate(block_n=128, warps=4, stages=None, target=528),
    _candidate(block_n=64, warps=4, stages=None, target=264),
    _candidate(block_n=64, warps=4, stages=None, target=528),
    _candidate(block_n=64, warps=2, stages=None, target=528),
    _candidate(block_n=64, warps=2, stages=None, target=1056),
]
PER_HEAD_SWEEP = [_candidate(block_n=128, warps=4, stages=None, target=528),
                  _candidate(block_n=128, warps=4, stages=2, target=528),
                  _candidate(block_n=64, warps=2, stages=None, target=1056)]


PREFILL_CASES = [(8192, 512), (32768, 512), (130560, 512), (129024, 2048), (4000, 37), (40000, 20)]  # (ctx, QL)


def bench_prefill(dev: str) -> str:
    """Prefill rows of one layer at one rank's shape: check the kernel route, time both routes."""
    from bonsai_vllm.kv.paged import PagedK3V2

    g = PagedK3V2(K3V2, 2176, guard=4)
    hq, hkv = SHAPES["rank"]
    lines = ["| context | QL | kernel vs torch rel. err | torch route ms | peak MiB | kernel route ms | peak MiB "
             "| bf16 SDPA ms |", "|---|---|---|---|---|---|---|---|"]
    gen = torch.Generator(device=dev).manual_seed(11)
    for ctx, ql in PREFILL_CASES:
        n = ctx + ql
        nb = -(-n // g.block_size)
        cache = torch.zeros(nb, hkv, g.page_bytes, dtype=torch.uint8, device=dev)
        table = torch.randperm(nb, device=dev).int()
        pos = torch.arange(n, device=dev)
        slots = table.long()[pos // g.block_size] * g.block_size + pos % g.block_size
        for a in range(0, n, 8192):
            k = torch.randn(min(8192, n - a), hkv, D, generator=gen, device=dev)
            g.write(cache, k, torch.randn(k.shape, generator=gen, device=dev), slots[a:a + 8192], use_kernels=True)
        q = torch.randn(ql, hq, D, generator=gen, device=dev)
        if ql <= g.window:  # the row's own tokens as the ring holds them
            _, bf = g.views(cache)
            own = pos[n - ql:]
            kv = g._bf16_at(bf, table[None, :].expand(ql, -1), own, own < g.sink).float()
            k_own, v_own = kv[:, :, 0], kv[:, :, 1]
        else:
            k_own = torch.randn(ql, hkv, D, generator=gen, device=dev)
            v_own = torch.randn(ql, hkv, D, generator=gen, device=dev)

        def run(kern: bool):
            return g.prefill_row(q, k_own, v_own, cache, table, n, SM_SCALE, use_kernels=kern)

        err = ref.rel_err(run(True), run(False))
        check(f"prefill kernel route ctx {ctx} QL {ql}", err < 2e-3, f"rel err {err:.2e} vs torch route")
        res = []
        for kern in (False, True):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            run(kern)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            res.append((time_eager(lambda: run(kern)) / 1e3, peak))  # eager: the route syncs with the host
        kk = torch.randn(1, hq, n, D, generator=gen, device=dev).bfloat16()
        qq = torch.randn(1, hq, ql, D, generator=gen, device=dev).bfloat16()
        sdpa = time_eager(lambda: F.scaled_dot_product_attention(qq, kk, kk), reps=10) / 1e3
        lines.append(f"| {ctx} | {ql} | {err:.1e} | {res[0][0]:.2f} | {res[0][1]:.0f} | {res[1][0]:.2f} | "
                     f"{res[1][1]:.0f} | {sdpa:.2f} |")
        say(lines[-1])
        cache = kk = qq = None  # this context's pages and keys go before the next, longer one is allocated
        torch.cuda.empty_cache()
    return "\n".join(lines)


def sweep_configs(cx: Ctx, grouped: bool, cfgs: list[Candidate], label: str, stop_s: float | None = None,
                  note=lambda t: "") -> list[tuple[float, Candidate]]:
    """Time decode with each configuration (one that raises is reported and skipped); stop past stop_s
    seconds of the run once something was timed. -> [(µs, cfg)]"""
    rows = []
    for cfg in cfgs:
        if stop_s is not None and elapsed() > stop_s and rows:
            say(f"  sweep stopped at {elapsed():.0f} s (budget)")
            break
        try:
            t = time_decode(cx, grouped, cfg)
        except Exception as e:
            say(f"  sweep {label} {cfg}: {type(e).__name__}: {str(e)[:160]}")
            continue
        rows.append((t, cfg))
        say(f"  sweep {label} 80k full {cfg}: {t:.1f} µs{note(t)}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop sweeping/timing extras past this")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--quick-checks", action="store_true", help="skip the store check (decode and layer checks only)")
    ap.add_argument("--profile", metavar="JSON",
                    help="only run one 80k full-shape decode twice with this config (a bench-kv.json, whose "
                         "'best' is used, or a config dict), for `ncu -k regex:_decode --launch-skip 1`")
    ap.add_argument("--prefill", action="store_true", help="check and time prefill rows only (see above)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kv needs a CUDA GPU (the CPU tests cover the kernels through Triton's interpreter)")
        return 2
    dev = "cuda"
    import triton

    if args.prefill:
        say(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
        return _finish(args, {"prefill": True}, bench_prefill(dev))

    if args.profile:
        from bonsai_vllm.kv.kernels.decode import auto_splits, decode

        src = Path(args.profile)
        raw = json.loads(src.read_text()) if src.exists() else json.loads(args.profile)
        cand = Candidate.from_dict(raw.get("best", raw))
        cx = Ctx(K3V2, 24, 4, CONTEXTS[-1], 1, dev=dev)
        splits = auto_splits(cx.nq, 1, cx.hkv, cand.config.tile(BLOCK_SIZE), target_programs=cand.target)
        for _ in range(2):
            decode(*cx.args(0), config=cand.config, num_splits=splits)
        torch.cuda.synchronize()
        print(f"profiled config {cand}, {splits} splits")
        return 0

    try:
        return _run(args, dev, triton)
    except Exception:
        import traceback

        say(traceback.format_exc())
        FAILURES.append("exception (see log)")
        return _finish(args, {}, "")


def _run(args, dev, triton) -> int:
    say(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}

    if not args.quick_checks:
        check_store(dev)
    check_decode(dev)
    check_layer(dev)
    say(f"checks done at {elapsed():.0f} s")

    bws = copy_bandwidth(dev)
    bw = max(bws.values())
    results["copy_bw_TBps"] = {k: v / 1e12 for k, v in bws.items()}
    say("copy bandwidth (read + write): " + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in bws.items())
        + f"; floor uses {bw / 1e12:.2f}")

    # ---- sweep at 80k, full shape, grouped
    sweep = [c for c in SWEEP if CFG_OK.get(c.config, False)]
    if args.no_sweep:
        sweep = sweep[:1]
    cx = Ctx(K3V2, 24, 4, CONTEXTS[-1], copies_for(CONTEXTS[-1] * 4 * K3V2.slot_bytes), dev=dev)
    floor80 = cx.bytes() / bw * 1e6
    rows = sweep_configs(cx, True, sweep, "grouped", stop_s=args.budget_s * 0.55,
                         note=lambda t: f" ({t / floor80:.2f}× floor {floor80:.1f} µs)")
    if not rows:
        say("no kernel configuration could be timed")
        FAILURES.append("sweep: nothing timed")
        return _finish(args, results, "")
    best = min(rows, key=lambda r: r[0])[1]
    per_head = [c for c in (PER_HEAD_SWEEP if not args.no_sweep else PER_HEAD_SWEEP[:1]) if CFG_OK.get(c.config, False)]
    ph_rows = sweep_configs(cx, False, per_head, "per-head")
    best_ph = min(ph_rows, key=lambda r: r[0])[1] if ph_rows else best
    results["sweep"] = [dict(cfg.to_dict(), us=t) for t, cfg in rows]
    results["sweep_per_head"] = [dict(cfg.to_dict(), us=t) for t, cfg in ph_rows]
    results["best"], results["best_per_head"] = best.to_dict(), best_ph.to_dict()
    say(f"best grouped {best}, best per-head {best_ph} ({elapsed():.0f} s)")
    del cx
    if dev == "cuda":
        torch.cuda.empty_cache()

    # ---- the table
    table = []
    for shape, (hq, hkv) in SHAPES.items():
        for ctx in CONTEXTS:
            cx = Ctx(K3V2, hq, hkv, ctx, copies_for(ctx * hkv * K3V2.slot_bytes), seed=ctx, dev=dev)
            floor = cx.bytes() / bw * 1e6
            tg = time_decode(cx, True, best)
            tp = time_decode(cx, False, best_ph)
            ts = time_sdpa(hq, hkv, ctx, 1, dev)
            row = dict(shape=shape, hq=hq, hkv=hkv, ctx=ctx, grouped_us=tg, per_head_us=tp, sdpa_bf16_us=ts,
                       floor_us=floor, bytes=cx.bytes(), speedup_vs_per_head=tp / tg, x_floor=tg / floor,
                       achieved_TBps=cx.bytes() / (tg * 1e-6) / 1e12)
            if ctx == CONTEXTS[-1] and elapsed() < args.budget_s:
                cx2 = Ctx(K3V2, hq, hkv, ctx, cx.copies, ql=2, seed=ctx + 1, dev=dev)
                row["grouped_ql2_us"] = time_decode(cx2, True, best)
                del cx2
            table.append(row)
            say(f"  {shape} {hq}/{hkv} ctx {ctx}: grouped {tg:.1f} µs, per-head {tp:.1f} µs "
                f"({tp / tg:.2f}×), bf16 SDPA {ts:.1f} µs, floor {floor:.1f} µs ({tg / floor:.2f}× floor)")
            del cx
            if dev == "cuda":
                torch.cuda.empty_cache()
    results["table"] = table

    lines = ["| shape | ctx | K3V2 grouped µs | K3V2 per-query-head µs | grouped speed-up | bf16 SDPA µs "
             "| floor µs | grouped / floor | grouped QL=2 µs |", "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['shape']} {r['hq']}/{r['hkv']} | {r['ctx'] // 1024}k | {r['grouped_us']:.1f} | "
                     f"{r['per_head_us']:.1f} | {r['speedup_vs_per_head']:.2f}× | {r['sdpa_bf16_us']:.1f} | "
                     f"{r['floor_us']:.1f} | {r['x_floor']:.2f}× | "
                     f"{r.get('grouped_ql2_us', float('nan')):.1f} |")
    md = "\n".join(lines)
    say("")
    say(f"K3V2 decode attention, one full-attention layer, head_dim 256, B = 1 (copy {bw / 1e12:.2f} TB/s; "
        f"grouped {best}; per-head {best_ph})")
    say(md)
    return _finish(args, results, md)


def _finish(args, results: dict, md: str) -> int:
    results["failures"] = FAILURES
    results["elapsed_s"] = elapsed()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-kv.md").write_text(md + "\n\n" + "\n".join(LOG) + "\n")
    (out / "bench-kv.json").write_text(json.dumps(results, indent=1))
    if FAILURES:
        print("FAILED checks:\n  " + "\n  ".join(FAILURES))
        return 1
    say(f"all checks passed; {elapsed():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
