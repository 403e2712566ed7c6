"""Check, then time, every Triton kernel of ternary/kernels and comm/ at the 27B's per-rank TP=2 shapes (`make bench-kernels`).

    PYTHONPATH=plugin python -m benchmarks.kernels [--sweep] [--out DIR]

On a CUDA GPU, one run:
1. checks every kernel against the core's PyTorch reference on fresh random inputs at the real shapes,
   outputs poisoned (NaN / -128) first; a failed check is printed and makes the exit status 1;
2. measures the device-to-device copy bandwidth (bytes read + written), the ceiling for memory-bound code;
3. times, as CUDA-graph replays over enough weight copies that nothing is served from L2, our path, bf16
   cuBLAS on dense weights of the same shape, the reference plugin's approach (dequantize to bf16, then
   matmul) for M >= 64, and the bandwidth floor for the bytes moved; then the elementwise kernels at
   2048×5120 against the copy bandwidth;
4. prints one table (and writes bench.md / bench.json / sweep.txt to --out, default $OUT or .).

Shapes are per rank at TP=2: down_proj's 8704 is not a multiple of the 1024 Hadamard block (the split cuts
block 8), so the GEMV and matmuls are timed on rotated input and the Hadamard on 1024-blocks of 2048×5120.
`--sweep` also times alternative tile configurations; "ours" is the fastest checked candidate, and the
dispatch tables (gemv.default_config, int8mm.default_config, linear.GEMV_MAX_M) were set from that sweep,
for M <= 16 from bench_decode's (split-K and multi-row GEMV variants, int8 with a 16-row tile).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bonsai_vllm.comm.kernels import Tiles
from bonsai_vllm.ternary.format import pack_ternary
from bonsai_vllm.ternary.kernels.gemv import GemvConfig
from bonsai_vllm.ternary.kernels.int8mm import Int8GemmConfig
from bonsai_vllm.ternary.reference import signed_block_hadamard
from bonsai_vllm.ternary.reference import dequantize, int8_decompose

# (name, K per rank, N per rank) at TP=2.
SHAPES = [("gate_up", 5120, 17408), ("down", 8704, 5120), ("qkv", 5120, 7168), ("o_proj", 3072, 5120),
          ("gdn_in", 5120, 8192), ("gdn_out", 3072, 5120)]
MS = [1, 4, 16, 32, 64, 512, 2048]  # 32: not asked for, but it places the GEMV / int8 crossover
DECODE_MS = [m for m in MS if m <= 64]
PREFILL_MS = [m for m in MS if m >= 64]
INT8_MIN_M = 4  # batch sizes from which the int8 path (W8 kept at load) is timed too

FMA_SWEEP = [GemvConfig(variant="fma", bm=1, bn=32, bw=32, warps=4, stages=1),
             GemvConfig(variant="fma", bm=1, bn=64, bw=32, warps=4, stages=1),
             GemvConfig(variant="fma", bm=1, bn=16, bw=32, warps=2, stages=1),
             GemvConfig(variant="fma", bm=1, bn=32, bw=32, warps=2, stages=1),
             GemvConfig(variant="fma", bm=1, bn=64, bw=32, warps=8, stages=1),
             GemvConfig(variant="fma", bm=1, bn=128, bw=32, warps=8, stages=1),
             GemvConfig(variant="fma", bm=1, bn=16, bw=32, warps=1, stages=1),
             GemvConfig(variant="fma", bm=1, bn=32, bw=16, warps=2, stages=1)]
DOT_SWEEP = [dict(bn=32, bw=16, warps=2, stages=3), dict(bn=32, bw=16, warps=4, stages=3),
             dict(bn=32, bw=32, warps=4, stages=2), dict(bn=64, bw=32, warps=4, stages=2),
             dict(bn=16, bw=16, warps=1, stages=3)]  # GemvConfig fields of "dot" but bm (_bm_for(M))
DOT_SWEEP_BIG_M = [dict(bn=32, bw=16, warps=2, stages=3), dict(bn=64, bw=32, warps=4, stages=2)]
GEMM_SWEEP = [Int8GemmConfig(bm=128, bn=128, bk=64, group_m=8, warps=4, stages=4),
              Int8GemmConfig(bm=64, bn=128, bk=128, group_m=8, warps=4, stages=4),
              Int8GemmConfig(bm=128, bn=128, bk=128, group_m=8, warps=8, stages=4),
              Int8GemmConfig(bm=128, bn=256, bk=64, group_m=8, warps=8, stages=3),
              Int8GemmConfig(bm=64, bn=128, bk=64, group_m=8, warps=4, stages=4),
              Int8GemmConfig(bm=128, bn=128, bk=64, group_m=8, warps=8, stages=3)]
ALLREDUCE_TILES = [Tiles(rows=4, groups=8)]  # comm.kernels._tiles' choice; --sweep adds the others
ALLREDUCE_SWEEP = [Tiles(rows=2, groups=8), Tiles(rows=8, groups=8), Tiles(rows=4, groups=4), Tiles(rows=16, groups=4),
                   Tiles(rows=8, groups=16)]
QUANT_BMS = [1, 2, 4]
DOT_TOL = 5e-3  # relative error allowed to the GEMV's tensor-core path (three bf16 roundings)


def gemv_configs(m: int, sweep: bool, n: int = 0, k: int = 0) -> list:
    from bonsai_vllm.ternary.kernels import gemv

    cfgs = [gemv.default_config(m, n, k)]  # n = k = 0: the rule for shapes outside gemv._MEASURED
    if sweep:
        if m == 1:
            cfgs += FMA_SWEEP
        if m == 4:
            cfgs += FMA_SWEEP[:2]
        cfgs += [GemvConfig(variant="dot", bm=_bm_for(m), **c) for c in (DOT_SWEEP if m <= 16 else DOT_SWEEP_BIG_M)]
    return list(dict.fromkeys(cfgs))


FAILURES: list[str] = []
LOG: list[str] = []


def report(out: Path, stem: str, data: dict, lines: list[str], failures: list[str]) -> int:
    """The end of a check-then-time benchmark: `data` as out/stem.json, the table `lines` as out/stem.md and on
    stdout, then the check failures; the exit status is 1 if any check failed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({**data, "failures": failures}, indent=1))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("\n## check failures\n" + ("\n".join(failures) if failures else "none"))
    return 1 if failures else 0


def say(*a) -> None:
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not torch.isfinite(a).all():
        return float("inf")  # poison left (an element never written) or a NaN produced
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check(name: str, err: float, tol: float, verbose: bool = True) -> bool:
    if SMOKE and tol in (3e-3, DOT_TOL):  # bf16: the interpreter's float32 -> bf16 truncates (test_kernels.py)
        tol = 2 * tol
    ok = err < tol
    if not ok:
        FAILURES.append(f"{name}: error {err:.3g} >= {tol:.3g}")
    if verbose or not ok:
        say(f"  check {'ok  ' if ok else 'FAIL'} {name}: {err:.2e} (tol {tol:.0e})")
    return ok


def guard(name: str, fn, *args, **kw):
    """Run one check or timing; an exception (a kernel that does not compile here, say) is recorded as a
    failure and the run goes on to the next item."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - recorded, printed, and the exit status says so
        FAILURES.append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
        say(f"  ERROR {name}: {type(e).__name__}: {str(e)[:400]}")
        return None


def nan(*shape, dtype=torch.bfloat16, device="cuda") -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def random_layer(n: int, k: int, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(-1, 2, (n, k), generator=g, device=device, dtype=torch.int8)
    scales = (0.01 + 0.04 * torch.rand(n, k // 128, generator=g, device=device)).to(torch.float16)
    signs = torch.randint(0, 2, (k,), generator=g, device=device).float() * 2 - 1
    return pack_ternary(codes), scales, signs


@dataclass
class ServedCopies:
    """One random ternary layer [N, K] as the 12 GB cards serve it (W8 not kept: linear.prepare's routes, input
    taken as rotated) beside its bf16 twin, each in enough copies that consecutive calls miss L2."""

    packed: torch.Tensor  # int32 [N, K/16]
    scales: torch.Tensor  # fp16 [N, K/128]
    w_ref: torch.Tensor  # float32 [N, K], the dequantized layer
    signs: torch.Tensor  # ±1 float32 [K]: Hadamard signs for a caller that prepares the copies unrotated
    tern: list  # (packed, scales) copies
    served: list  # linear.TernaryWeights of each copy
    dense: list  # bf16 [N, K] copies
    nbytes: float  # codes + scales: the byte floor's bytes

    @property
    def copies(self) -> int:
        return len(self.tern)


def served_copies(n: int, k: int, device, seed: int, l2: int) -> ServedCopies:
    from bonsai_vllm.ternary.kernels import linear

    packed, scales, signs = random_layer(n, k, device, seed)
    w_ref = dequantize(packed, scales, 128)
    nbytes = n * k / 4 + n * k / 128 * 2
    tern = [(packed.clone(), scales.clone()) for _ in range(n_copies(int(nbytes), l2))]
    served = [linear.prepare(p, s, None, expand_int8=False) for p, s in tern]
    dense = [w_ref.to(torch.bfloat16) for _ in range(n_copies(2 * n * k, l2))]
    return ServedCopies(packed, scales, w_ref, signs, tern, served, dense, nbytes)


def randn(*shape, device, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device).to(dtype)


# --------------------------------------------------------------------------------------------- checks

def check_gemv(packed, scales, w_ref, m, config, device, seed, verbose=True, name="", prepared=True) -> bool:
    from bonsai_vllm.ternary.kernels.gemv import ternary_gemv
    from bonsai_vllm.ternary.kernels.hadamard import gemv_order

    from bonsai_vllm.ternary.kernels.gemv import default_config, x_dtype

    n, k = w_ref.shape
    x = randn(m, k, device=device, seed=seed)
    cfg = config or default_config(m, n, k)
    dt = x_dtype(cfg)
    y = ternary_gemv(gemv_order(x, dtype=dt) if prepared else x, packed, scales, prepared=prepared,
                     out=nan(m, n, device=device), config=config)
    tag = "" if prepared else " (unprepared x)"
    # fma: one bf16 rounding (the output). dot: three (x', weight × scale, output): √3 × 1.7e-3 ≈ 2.9e-3.
    tol = 3e-3 if cfg.variant == "fma" else DOT_TOL
    return check(f"gemv {name} M={m} {config}{tag}", rel(y, x.float() @ w_ref.t()), tol, verbose)


def check_prefill(packed, scales, w_ref, m, device, seed, verbose=True, name="", gemm_config=None) -> bool:
    from bonsai_vllm.ternary.kernels import hadamard, int8mm

    n, k = w_ref.shape
    xr = randn(m, k, device=device, seed=seed)
    q, rs = int8mm.int8_scales(scales)
    w8 = int8mm.expand_int8(packed, q, out=torch.full((n, k), -128, dtype=torch.int8, device=device))
    w8_ref, rs_ref = int8_decompose(packed, scales, 128)
    ok = check(f"expand_int8 {name}", 0.0 if torch.equal(w8, w8_ref) else 1.0, 0.5, verbose)
    ok &= check(f"int8 row scale {name}", rel(rs, rs_ref), 1e-7, verbose)
    xq, ts = hadamard.quantize_per_token(
        xr, out=(torch.full((m, k), -128, dtype=torch.int8, device=device), nan(m, dtype=torch.float32, device=device)))
    xq_ref, ts_ref = hadamard.quantize_per_token_ref(xr)
    d = (xq.int() - xq_ref.int()).abs()
    ok &= check(f"quantize_per_token {name} M={m}", 1.0 if d.max() > 1 else (d > 0).float().mean().item(), 1e-3,
                verbose)
    # float64 products of int8 codes are exact, at every M (torch._int_mm refuses M <= 16, which left the
    # Triton GEMM untimed at M = 4 and 16 before 2026-12-01)
    y_ref_int8 = ((xq_ref.double() @ w8_ref.double().t()) * ts_ref[:, None].double() * rs_ref[None, :].double())
    y_ref = xr.float() @ w_ref.t()
    ys = [(f"int8_gemm {gemm_config}", int8mm.int8_gemm(xq, w8, ts, rs, None, torch.bfloat16,
                                                       out=nan(m, n, device=device), config=gemm_config))]
    if m > 16:  # torch._int_mm refuses M <= 16
        ys.append(("int_mm+rescale", int8mm.int_mm_linear(xq, w8, ts, rs, None, torch.bfloat16,
                                                          out=nan(m, n, device=device))))
    for tag, y in ys:
        ok &= check(f"{tag} {name} M={m} vs int8 ref", rel(y, y_ref_int8), 3e-3, verbose)
        ok &= check(f"{tag} {name} M={m} vs float32 judge", rel(y, y_ref), 2e-2, verbose)
    return ok


def run_checks(device, verbose: bool = True, shapes=None) -> list[str]:
    """All correctness checks at the real shapes; returns the failures (also used by tests/core/test_kernels.py)."""
    from bonsai_vllm.ternary.kernels import linear

    torch.backends.cuda.matmul.allow_tf32 = False
    start = len(FAILURES)
    for i, (name, k, n) in enumerate(shapes or SHAPES):
        packed, scales, signs = random_layer(n, k, device, 100 + i)
        w_ref = dequantize(packed, scales, 128)  # float32 [N, K]
        for m in DECODE_MS:
            guard(f"gemv {name} M={m}", check_gemv, packed, scales, w_ref, m, None, device, 200 + m, verbose, name)
        guard(f"gemv {name} unprepared", check_gemv, packed, scales, w_ref, 1, None, device, 250, verbose, name,
              prepared=False)
        guard(f"prefill {name}", check_prefill, packed, scales, w_ref, PREFILL_MS[1], device, 300 + i, verbose, name)
        if k % 1024 == 0:  # the whole layer through the dispatcher, unrotated input
            tw = linear.prepare(packed, scales, signs)
            for m in (1, 16, PREFILL_MS[1]):
                x = randn(m, k, device=device, seed=400 + m)
                y_ref = signed_block_hadamard(x.float(), signs, 1024) @ w_ref.t()
                guard(f"ternary_linear {name} M={m}", lambda: check(
                    f"ternary_linear {name} M={m}", rel(linear.ternary_linear(x, tw), y_ref),
                    3e-3 if m == 1 else (DOT_TOL if m <= linear.GEMV_MAX_M_NO_W8 else 2e-2), verbose))
        del w_ref
    guard("hadamard / quantize checks", _check_hadamard, verbose)
    guard("all-reduce checks", _check_allreduce, verbose)
    return FAILURES[start:]


def _check_hadamard(verbose: bool) -> None:
    from bonsai_vllm.ternary.kernels import hadamard

    device = "cpu" if SMOKE else "cuda"
    em, ek = ELEMENTWISE
    signs = random_layer(16, ek, device, 7)[2]
    for m in (1, em):
        x = randn(m, ek, device=device, seed=500 + m)
        y = hadamard.block_hadamard(x, signs, 1024, out=nan(m, ek, device=device))
        ref = signed_block_hadamard(x.float(), signs, 1024)
        check(f"block_hadamard 1024 {m}x{ek}", rel(y, ref), 3e-3, verbose)
        y = hadamard.block_hadamard(x, signs, 1024, gemv_order=True, out=nan(m, ek, dtype=torch.float32, device=device))
        check(f"block_hadamard -> x' {m}x{ek}", rel(y, hadamard.gemv_order_ref(ref)), 1e-5, verbose)
        q, ts = hadamard.quantize_per_token(x, signs)
        q_ref, ts_ref = hadamard.quantize_per_token_ref(ref)
        d = (q.int() - q_ref.int()).abs()
        check(f"rotate+quantize {m}x{ek}", 1.0 if d.max() > 1 else (d > 0).float().mean().item(), 1e-3, verbose)
        check(f"rotate+quantize {m}x{ek} scales", rel(ts, ts_ref), 1e-5, verbose)
    x = randn(em, 512, device=device, seed=600)  # a TP=2 rank's half of down_proj's cut block
    check(f"block_hadamard 512 {em}x512", rel(hadamard.block_hadamard(x, signs[:512], 512),
                                              signed_block_hadamard(x.float(), signs[:512], 512)), 3e-3, verbose)


def _check_allreduce(verbose: bool) -> None:
    from bonsai_vllm.comm import reference as core_allreduce
    from bonsai_vllm.comm import kernels as allreduce

    device = "cpu" if SMOKE else "cuda"
    em, ek = ELEMENTWISE
    parts = [randn(em, ek, device=device, seed=601 + r) for r in range(2)]
    want = [core_allreduce.pack(p) for p in parts]
    bufs = [allreduce.pack(p, out=torch.full_like(w, 0x80)) for p, w in zip(parts, want)]
    # Not bit-identical on the GPU: there PyTorch divides by the scalar 127 as a multiply by its float32
    # reciprocal, the kernel (and PyTorch on CPU) divides; a scale can differ by an ulp and a code on a tie
    # by one. The CPU tests check bit-identity.
    codes = em * ek
    for r, (b, w) in enumerate(zip(bufs, want)):
        d = (b[:codes].view(torch.int8).int() - w[:codes].view(torch.int8).int()).abs()
        check(f"pack {em}x{ek} rank {r} codes", 1.0 if d.max() > 1 or (b[:codes] == 0x80).any() else
              (d > 0).float().mean().item(), 1e-3, verbose)
        check(f"pack {em}x{ek} rank {r} scales", rel(b[codes:].view(torch.float32), w[codes:].view(torch.float32)),
              1e-6, verbose)
    packed = torch.stack(want)
    y = allreduce.unpack_sum(packed, (em, ek), out=nan(em, ek, dtype=torch.float32, device=device))
    check(f"unpack_sum {em}x{ek} float32 (bit-identical)",
          0.0 if torch.equal(y, core_allreduce.unpack_sum(packed, (em, ek))) else 1.0, 0.5, verbose)
    y = allreduce.unpack_sum(packed, (em, ek), out_dtype=torch.bfloat16, out=nan(em, ek, device=device))
    check(f"unpack_sum {em}x{ek} -> bf16", rel(y, core_allreduce.unpack_sum(packed, (em, ek))), 3e-3, verbose)


# -------------------------------------------------------------------------------------------- timing

def _sync():
    if not SMOKE:
        torch.cuda.synchronize()


# A CUDA green context (on_sms) and its stream: graphs are then captured and replayed on that stream, so every
# timed kernel runs on the context's SMs only. The context is kept here: its stream dies with it.
GREEN_CONTEXT = GREEN_STREAM = None


def on_sms(sms: int) -> None:
    """Time everything from here on `sms` SMs of the GPU (a green context; PyTorch >= 2.9, sm_90 and later):
    with the RTX occupancy padding, the closest the H200 comes to an RTX 5070's 48 SMs (its bandwidth and
    clocks stay the H200's)."""
    global GREEN_CONTEXT, GREEN_STREAM
    from torch.cuda import green_contexts

    GREEN_CONTEXT = green_contexts.GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
    GREEN_STREAM = GREEN_CONTEXT.Stream()


def time_graph(fn, copies: int, calls: int, reps: int = 10) -> float:
    """Median µs per call of fn(i), i cycling over `copies` buffer sets, replayed from one CUDA graph (on the
    green context's SMs after on_sms)."""
    if SMOKE:  # CPU dry run of the bench's code paths: run once, report a dummy time
        fn(0)
        return 1.0
    if GREEN_STREAM is not None:
        with torch.cuda.stream(GREEN_STREAM):
            return _time_graph_on(fn, copies, calls, reps, GREEN_STREAM)
    return _time_graph_on(fn, copies, calls, reps, None)


def _time_graph_on(fn, copies: int, calls: int, reps: int, capture_stream) -> float:
    calls = max(calls, copies)
    stream = torch.cuda.Stream() if capture_stream is None else capture_stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(copies, 3)):  # compile / warm up outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / calls)
    del graph
    return statistics.median(times)


def time_eager(fn, reps: int = 3) -> float:
    if SMOKE:
        fn()
        return 1.0
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second: the best of an eager copy_, a
    graph-captured copy_ (a memcpy node, which may go to a copy engine) and an SM kernel (neg)."""
    if SMOKE:
        return 1e12
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * 4
    res = {"eager copy_": time_eager(lambda: dst.copy_(src), reps=5),
           "graph copy_": time_graph(lambda i: dst.copy_(src), 1, 5),
           "graph neg (SM kernel)": time_graph(lambda i: torch.neg(src, out=dst), 1, 5)}
    for k_, us in res.items():
        say(f"  copy 1 GiB, {k_}: {nbytes / us / 1e6:.3f} TB/s")
    return nbytes / (min(res.values()) * 1e-6)


def n_copies(nbytes: int, l2: int) -> int:
    """Buffer sets to cycle so that consecutive calls touch >= 3 L2s of distinct memory."""
    return 1 if SMOKE else max(2, -(-3 * l2 // max(nbytes, 1)))


def calls_for(est_us: float) -> int:
    return int(min(200, max(5, 2000 / max(est_us, 1.0))))


def _bm_for(m: int) -> int:
    return 16 if m <= 16 else (32 if m <= 32 else 64)


def bench_layer(name, k, n, bw, l2, device, sweep: bool, seed: int, rows: list, sweep_rows: list):
    from bonsai_vllm.ternary.kernels import int8mm

    packed, scales, signs = random_layer(n, k, device, seed)
    w_ref = dequantize(packed, scales, 128)
    q, rs = int8mm.int8_scales(scales)
    tern_bytes = packed.numel() * 4 + scales.numel() * 2
    ct = n_copies(tern_bytes, l2)
    tern = [(packed, scales)] + [(packed.clone(), scales.clone()) for _ in range(ct - 1)]
    dense0 = w_ref.to(torch.bfloat16)
    cd = n_copies(dense0.numel() * 2, l2)
    dense = [dense0] + [dense0.clone() for _ in range(cd - 1)]
    w8_0 = int8mm.expand_int8(packed, q)
    c8 = n_copies(w8_0.numel(), l2)
    w8s = [w8_0] + [w8_0.clone() for _ in range(c8 - 1)]

    for m in MS:
        guard(f"timing {name} M={m}", _bench_m, name, k, n, m, bw, device, sweep, seed, rows, sweep_rows, packed,
              scales, w_ref, q, rs, tern_bytes, tern, ct, dense, cd, w8s, c8)
    del tern, dense, w8s, w_ref
    if not SMOKE:
        torch.cuda.empty_cache()


def _bench_m(name, k, n, m, bw, device, sweep, seed, rows, sweep_rows, packed, scales, w_ref, q, rs, tern_bytes,
             tern, ct, dense, cd, w8s, c8):
    from bonsai_vllm.ternary.kernels import gemv, hadamard, int8mm, linear

    xr = randn(m, k, device=device, seed=seed + m)
    t_bf16 = time_graph(lambda i: F.linear(xr, dense[i]), cd, calls_for(50 if m < 512 else 500))
    floor = (tern_bytes + 2 * m * k + 2 * m * n) / bw * 1e6
    row = dict(layer=name, K=k, N=n, M=m, bf16_us=t_bf16, floor_us=floor, tern_floor_us=tern_bytes / bw * 1e6)
    cands = {}  # path label -> µs, every candidate the dispatcher could run at this M
    if m <= 64:
        xps = {dt: hadamard.gemv_order(xr, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
        best = None
        for cfg in gemv_configs(m, sweep, n, k):
            try:
                if not check_gemv(packed, scales, w_ref, m, cfg, device, seed + 7 * m, verbose=False, name=name):
                    continue
                xp = xps[gemv.x_dtype(cfg)]
                t = time_graph(lambda i: gemv.ternary_gemv(xp, tern[i][0], tern[i][1], prepared=True, config=cfg),
                               ct, calls_for(10 * max(1, m // 16)))
            except Exception as e:  # a config that does not compile here (shared memory, say): record, go on
                say(f"  gemv {name} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            sweep_rows.append(f"gemv {name} K={k} N={n} M={m} {cfg}: {t:.2f} us")
            cands[f"gemv {cfg}"] = t
            best = (t, cfg) if best is None or t < best[0] else best
        if best is not None:
            row["gemv_us"], row["gemv_cfg"] = best
        row["order_us"] = time_graph(lambda i: hadamard.gemv_order(xr, dtype=torch.bfloat16), 1, 100)
    if m >= INT8_MIN_M:
        qt = {}
        for b in QUANT_BMS:
            qt[b] = time_graph(lambda i: hadamard.quantize_per_token(xr, bm=b), 1, calls_for(10))
            sweep_rows.append(f"quantize_per_token {name} K={k} M={m} bm={b}: {qt[b]:.2f} us")
        bq = min(qt, key=qt.get)
        row["quant_us"], row["quant_bm"] = qt[bq], bq
        xq, ts = hadamard.quantize_per_token(xr)
        if m > 16:  # torch._int_mm refuses M <= 16
            t_mm = time_graph(lambda i: int8mm.int_mm_linear(xq, w8s[i], ts, rs), c8, calls_for(400))
            cands["int8 int_mm"] = row["quant_us"] + t_mm
            row["int_mm_us"] = t_mm
        best = None
        dcfg = int8mm.default_config(m, n, k)
        for cfg in dict.fromkeys(([dcfg] if dcfg.backend == "triton" else []) + (GEMM_SWEEP if sweep else [])):
            try:
                if not check_prefill(packed, scales, w_ref, m, device, seed + 11, False, name, cfg):
                    continue
                t = time_graph(lambda i: int8mm.int8_gemm(xq, w8s[i], ts, rs, config=cfg), c8, calls_for(400))
            except Exception as e:
                say(f"  int8_gemm {name} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            sweep_rows.append(f"int8_gemm {name} K={k} N={n} M={m} {cfg}: {t:.2f} us")
            cands[f"int8 {cfg}"] = row["quant_us"] + t
            best = (t, cfg) if best is None or t < best[0] else best
        if best is not None:
            row["triton_gemm_us"], row["triton_gemm_cfg"] = best
        row["expand_us"] = time_graph(lambda i: int8mm.expand_int8(tern[i][0], q), ct, calls_for(30))
    if m >= 64:
        row["deq_mm_us"] = time_eager(lambda: F.linear(xr, dequantize(packed, scales, 128).to(torch.bfloat16)))
    # "ours": what linear.ternary_linear runs at this M (W8 kept at load); "best": the fastest checked
    # candidate of the run (with --sweep; the dispatch tables were set from such a sweep).
    if m <= linear.GEMV_MAX_M:
        disp = f"gemv {gemv.default_config(m, n, k)}"
    else:
        disp = f"int8 {int8mm.default_config(m, n, k)}"  # "int8 int_mm" or "int8 triton bm=…"
    row["best_us"], row["best_path"] = min((v, kk) for kk, v in cands.items())
    row["ours_us"], row["path"] = (cands[disp], disp) if disp in cands else (row["best_us"], row["best_path"])
    rows.append(row)
    say(f"  {name:8s} M={m:5d} ours {row['ours_us']:8.2f} us ({row['path']}), bf16 {t_bf16:8.2f}, "
        f"floor {floor:6.2f}")


def bench_elementwise(bw, l2, device, sweep: bool, rows: list, sweep_rows: list):
    from bonsai_vllm.comm import kernels as allreduce
    from bonsai_vllm.ternary.kernels import hadamard

    m, k = ELEMENTWISE
    signs = random_layer(16, k, device, 9)[2]
    c = n_copies(m * k * 2, l2)
    xs = [randn(m, k, device=device, seed=700 + i) for i in range(c)]
    outs = [torch.empty(m, k, dtype=torch.bfloat16, device=device) for _ in range(c)]

    def record(kernel, nbytes, t, note="", shape=f"{m}x{k}", bandwidth=True):
        rows.append(dict(kernel=kernel, shape=shape, us=t, bytes=nbytes, gbs=nbytes / t / 1e3,
                         frac=nbytes / (t * 1e-6) / bw if bandwidth else 0.0, note=note))
        say(f"  {kernel:30s} {shape:10s} {t:8.2f} us  {nbytes / t / 1e3:7.0f} GB/s  "
            f"{100 * nbytes / (t * 1e-6) / bw:5.1f}% of copy")

    best = None
    for bm, warps in ([(4, 4)] + ([(2, 4), (8, 4), (4, 8), (8, 8), (16, 8)] if sweep else [])):
        t = time_graph(lambda i: hadamard.block_hadamard(xs[i], signs, 1024, out=outs[i], bm=bm, num_warps=warps),
                       c, calls_for(20))
        sweep_rows.append(f"block_hadamard {m}x{k} bm={bm} warps={warps}: {t:.2f} us")
        best = (t, bm, warps) if best is None or t < best[0] else best
    record("block_hadamard (1024)", 4 * m * k, best[0], f"bm={best[1]} warps={best[2]}")
    qt = {b: time_graph(lambda i: hadamard.quantize_per_token(xs[i], bm=b), c, calls_for(30)) for b in QUANT_BMS}
    bq = min(qt, key=qt.get)
    record("int8 per token (rotated x)", 3 * m * k + 4 * m, qt[bq], f"bm={bq}; reads x twice (2nd from L2)")
    t = time_graph(lambda i: hadamard.quantize_per_token(xs[i], signs, bm=1), c, calls_for(30))
    record("rotate + int8 per token, fused", 3 * m * k + 4 * m, t,
           "bm=1; rotates twice (amax, then codes); the dispatcher runs rotate, then quantize instead")
    x1 = [randn(1, k, device=device, seed=800 + i) for i in range(4)]
    t = time_graph(lambda i: hadamard.block_hadamard(x1[i], signs, 1024), 4, 100)
    record("block_hadamard (1024)", 4 * k, t, "decode: latency-bound", f"1x{k}", False)
    for dt, nb in ((torch.float32, 6), (torch.bfloat16, 4)):
        t = time_graph(lambda i: hadamard.block_hadamard(x1[i], signs, 1024, gemv_order=True, dtype=dt), 4, 100)
        record(f"block_hadamard -> x' {str(dt)[6:]}", nb * k, t, "the decode path's rotation (writes the GEMV's x')",
               f"1x{k}", False)

    nbytes = m * k + 4 * m * (k // 128)  # one rank's pack
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(c)]
    packed = [torch.stack([allreduce.pack(xs[i]), allreduce.pack(xs[(i + 1) % c])]) for i in range(c)]
    best = None
    default_tiles = allreduce._tiles
    for tiles in ALLREDUCE_TILES + (ALLREDUCE_SWEEP if sweep else []):
        allreduce._tiles = lambda m_, n_, t_=tiles: t_  # noqa: E731 - sweep the tile shape in place
        try:
            tp = time_graph(lambda i: allreduce.pack(xs[i], out=bufs[i]), c, calls_for(20))
            tu = time_graph(lambda i: allreduce.unpack_sum(packed[i], (m, k), out_dtype=torch.bfloat16, out=outs[i]),
                            c, calls_for(20))
        finally:
            allreduce._tiles = default_tiles
        sweep_rows.append(f"pack/unpack_sum {m}x{k} tiles={tiles}: {tp:.2f} / {tu:.2f} us")
        best = (tp, tu, tiles) if best is None or tp + tu < best[0] + best[1] else best
    record("all-reduce pack (int8)", 2 * m * k + nbytes, best[0], f"tiles={best[2]}")
    record("all-reduce unpack_sum (2 ranks)", 2 * nbytes + 2 * m * k, best[1], f"tiles={best[2]}; bf16 out")
    bench_served_all_reduce(device, c, record)


def bench_served_all_reduce(device, c: int, record) -> None:
    """The served call itself, `tp_all_reduce` (what adapters/allreduce.py's op runs), against the PyTorch
    reference the adapter called before (comm.reference.int8_all_reduce), with one GPU standing in for two
    ranks: the gather stacks this rank's pack with the other rank's, as the all-gather's output would
    hold them (its copy is in both times: NCCL's transfer is not)."""
    from bonsai_vllm.comm import reference as ref
    from bonsai_vllm.comm import kernels as allreduce

    k = ELEMENTWISE[1]
    for m in (128, ELEMENTWISE[0]):
        xs = [randn(m, k, device=device, seed=900 + i) for i in range(c)]
        other = [allreduce.pack(randn(m, k, device=device, seed=950 + i)) for i in range(c)]
        route = allreduce.route(xs[0], 128)
        nbytes = 2 * m * k + 3 * (m * k + 4 * m * (k // 128)) + 2 * m * k  # read x, pack, gather, unpack, write
        t_served = time_graph(lambda i: allreduce.tp_all_reduce(
            xs[i], lambda b: torch.stack([b, other[i]]), lambda t: t, 128), c, calls_for(40))
        t_ref = time_graph(lambda i: ref.int8_all_reduce(xs[i], lambda b: torch.stack([b, other[i]])), c,
                           calls_for(200))
        record("served int8 all-reduce", nbytes, t_served,
               f"tp_all_reduce, route {route}; PyTorch reference {t_ref:.1f} us ({t_ref / t_served:.1f}x slower)",
               f"{m}x{k}")


def fmt_table(rows, erows, bw) -> str:
    from bonsai_vllm.ternary.kernels import int8mm

    out = [f"copy bandwidth (1 GiB D2D, read+write, best of three ways): {bw / 1e12:.2f} TB/s", "",
           "| layer K→N | M | ours µs | path (config) | bf16 cuBLAS µs | × vs bf16 | deq→bf16 mm µs | × vs deq | "
           "floor µs | ours/floor | ternary-weight floor µs | best variant µs |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        deq = r.get("deq_mm_us")
        deq_s = "" if deq is None else f"{deq:.1f}"
        deq_x = "" if deq is None else f"{deq / r['ours_us']:.2f}"
        out.append(f"| {r['layer']} {r['K']}→{r['N']} | {r['M']} | {r['ours_us']:.2f} | {r['path']} | "
                   f"{r['bf16_us']:.2f} | {r['bf16_us'] / r['ours_us']:.2f} | {deq_s} | {deq_x} | "
                   f"{r['floor_us']:.2f} | {r['ours_us'] / r['floor_us']:.2f} | {r['tern_floor_us']:.2f} | "
                   f"{r['best_us']:.2f}{'' if r['best_path'] == r['path'] else ' (' + r['best_path'] + ')'} |")
    out += ["", "| kernel | shape | µs | GB/s | % of copy bandwidth | note |", "| --- | --- | --- | --- | --- | --- |"]
    for r in erows:
        frac = f"{100 * r['frac']:.1f}" if r["frac"] else "–"
        out.append(f"| {r['kernel']} | {r['shape']} | {r['us']:.2f} | {r['gbs']:.0f} | {frac} | {r['note']} |")
    out += ["", "decode detail (µs): best GEMV config; reorder = gemv_order, x' from an already rotated x (the TP "
            "cut-block case; on the unrotated path the rotation kernel writes x' itself)", "",
            "| layer | M | gemv | config | reorder |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if "gemv_us" in r:
            out.append(f"| {r['layer']} | {r['M']} | {r['gemv_us']:.2f} | {r['gemv_cfg']} | {r['order_us']:.2f} |")
    out += ["", "prefill detail (µs): quantize = per-token int8 of rotated x (best rows-per-program bm); int_mm / "
            "triton = matmul + rescale only; expand = W8 from the codes per call (when W8 is not kept at load)", "",
            "| layer | M | quantize (bm) | int_mm+rescale | triton gemm (config) | expand W8 |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "quant_us" in r:
            # no Triton GEMM row where the dispatch takes cuBLAS _int_mm and no sweep ran ("–"), or where it failed
            tg = (f"{r['triton_gemm_us']:.1f} {r['triton_gemm_cfg']}" if "triton_gemm_us" in r
                  else "–" if int8mm.default_config(r["M"], r["N"], r["K"]).backend != "triton" else "failed")
            im = f"{r['int_mm_us']:.1f}" if "int_mm_us" in r else "–"
            out.append(f"| {r['layer']} | {r['M']} | {r['quant_us']:.1f} ({r['quant_bm']}) | {im} | "
                       f"{tg} | {r['expand_us']:.1f} |")
    return "\n".join(out)


def targets(rows, erows) -> list[str]:
    res = []

    def t(ok, text):
        res.append(f"{'MET   ' if ok else 'MISSED'} {text}")

    for r in rows:
        sp = r["bf16_us"] / r["ours_us"]
        if r["M"] == 1:
            t(sp >= 5, f"M=1 {r['layer']}: {sp:.2f}x faster than bf16 (target 5x)")
            f = r["ours_us"] / r["tern_floor_us"]
            t(f <= 2, f"M=1 {r['layer']}: {f:.2f}x the ternary-weight floor (target <= 2x)")
        if r["M"] == 16:
            t(sp >= 3, f"M=16 {r['layer']}: {sp:.2f}x faster than bf16 (target 3x)")
        if r["M"] in (512, 2048):
            d = r["deq_mm_us"] / r["ours_us"]
            t(d >= 1.5, f"M={r['M']} {r['layer']}: {d:.2f}x faster than dequant+matmul (target 1.5x)")
            t(r["ours_us"] <= 1.2 * r["bf16_us"], f"M={r['M']} {r['layer']}: {r['ours_us'] / r['bf16_us']:.2f}x "
              "bf16 cuBLAS time (target <= 1.2x)")
    for r in erows:
        if r["frac"]:
            t(r["frac"] >= 0.5, f"{r['kernel']} {r['shape']}: {100 * r['frac']:.0f}% of copy bandwidth (target 50%)")
    return res


# ------------------------------------------------------------------------- parallel compilation (warm)

def warm_tasks(sweep: bool, dev: str = "cuda") -> list:
    """Calls that compile every kernel configuration the run uses, with the same argument dtypes and
    divisibility as the real calls (M is never specialized), so N processes can fill Triton's cache."""
    from bonsai_vllm.comm import kernels as allreduce
    from bonsai_vllm.ternary.kernels import gemv, hadamard, int8mm

    k, n = 5120, 256
    packed, scales, signs = random_layer(n, k, dev, 1)
    q, rs = int8mm.int8_scales(scales)
    w8 = int8mm.expand_int8(packed, q)
    x = lambda m, kk=k: randn(m, kk, device=dev, seed=m)  # noqa: E731
    tasks = []
    cfgs = [c for m in DECODE_MS for _, kk, nn in SHAPES for c in gemv_configs(m, sweep, nn, kk)]
    for cfg in dict.fromkeys(cfgs):
        tasks.append(lambda cfg=cfg: gemv.ternary_gemv(hadamard.gemv_order(x(4), dtype=gemv.x_dtype(cfg)), packed,
                                                       scales, prepared=True, config=cfg))
    for kk in (5120, 8704):
        for m in (1, 4):
            for dt in (torch.float32, torch.bfloat16):
                tasks.append(lambda kk=kk, m=m, dt=dt: hadamard.gemv_order(x(m, kk), dtype=dt))
        for b in QUANT_BMS:
            tasks.append(lambda kk=kk, b=b: hadamard.quantize_per_token(x(64, kk), bm=b))
        tasks.append(lambda kk=kk: hadamard.quantize_per_token(x(512, kk)))
    for m in (1, 16):
        for dt in (torch.float32, torch.bfloat16):
            tasks.append(lambda m=m, dt=dt: hadamard.block_hadamard(x(m), signs, gemv_order=True, dtype=dt))
    for m in (1, 512):
        tasks.append(lambda m=m: hadamard.quantize_per_token(x(m), signs))
    tasks.append(lambda: hadamard.quantize_per_token(x(64), signs, bm=1))
    hb = [(1, 4), (2, 4), (4, 4)] + ([(8, 4), (4, 8), (8, 8), (16, 8)] if sweep else [])
    for bm, warps in hb:
        tasks.append(lambda bm=bm, warps=warps: hadamard.block_hadamard(x(64), signs, bm=bm, num_warps=warps))
    tasks.append(lambda: hadamard.block_hadamard(x(64, 512), signs[:512], 512))
    tasks.append(lambda: int8mm.int_mm_linear(hadamard.quantize_per_token(x(64), signs)[0], w8,
                                              torch.ones(64, device=dev), rs))
    for cfg in (GEMM_SWEEP if sweep else GEMM_SWEEP[:1]):
        tasks.append(lambda cfg=cfg: int8mm.int8_gemm(hadamard.quantize_per_token(x(64), signs)[0], w8,
                                                      torch.ones(64, device=dev), rs, config=cfg))
    tiles = ALLREDUCE_TILES + (ALLREDUCE_SWEEP if sweep else [])

    def pack_unpack(t):
        allreduce._tiles = lambda m_, n_: t
        b = allreduce.pack(x(64))
        allreduce.unpack_sum(torch.stack([b, b]), (64, k), out_dtype=torch.bfloat16)
        allreduce.unpack_sum(torch.stack([b, b]), (64, k))

    for t in tiles:
        tasks.append(lambda t=t: pack_unpack(t))
    return tasks


def warm_worker(index: int, jobs: int, sweep: bool) -> int:
    return run_warm_tasks(warm_tasks(sweep), index, jobs)


def run_warm_tasks(tasks: list, index: int, jobs: int) -> int:
    """Compile worker `index` of `jobs`: run every jobs-th task (each compiles one kernel configuration into
    Triton's on-disk cache); 1 if any failed (the main process meets the failure again and reports it)."""
    bad = 0
    for i in range(index, len(tasks), jobs):
        try:
            tasks[i]()
        except Exception as e:  # the main process meets it again and reports it
            bad += 1
            print(f"warm task {i}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    torch.cuda.synchronize()
    return 1 if bad else 0


def warm(jobs: int, sweep: bool) -> None:
    import subprocess
    import time

    t0 = time.time()
    cmd = [sys.executable, "-m", "benchmarks.kernels", "--jobs", str(jobs)] + (["--sweep"] if sweep else [])
    procs = [subprocess.Popen(cmd + ["--warm-worker", str(i)]) for i in range(jobs)]
    codes = [p.wait(timeout=600) for p in procs]
    say(f"## compiled in {jobs} processes in {time.time() - t0:.0f} s (worker exit codes {codes})")


# ----------------------------------------------------------------------------------------------- main

SMOKE = False
ELEMENTWISE = (2048, 5120)


def _smoke_setup() -> None:
    """CPU dry run of the whole bench through Triton's interpreter at toy shapes (times are dummies)."""
    global SMOKE, SHAPES, MS, DECODE_MS, PREFILL_MS, ELEMENTWISE
    SMOKE = True
    SHAPES = [("gate_up", 1024, 96), ("down", 1152, 64)]
    MS = [1, 4, 64, 128]
    DECODE_MS = [m for m in MS if m <= 64]
    PREFILL_MS = [m for m in MS if m >= 64]
    ELEMENTWISE = (16, 1024)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configurations")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench.md / bench.json / sweep.txt")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--elementwise-only", action="store_true",
                    help="time only the elementwise kernels and the served all-reduce (no layers)")
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling the kernels in parallel first (0: none)")
    ap.add_argument("--warm-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        _smoke_setup()
    elif not torch.cuda.is_available():
        print("bench_kernels: no CUDA device; on CPU the check is tests/core/test_kernels.py (Triton interpreter)")
        return 2
    if args.warm_worker is not None:
        return warm_worker(args.warm_worker, args.jobs, args.sweep)
    import triton

    dev = torch.device("cpu" if SMOKE else "cuda")
    if SMOKE:
        name, l2 = "CPU (Triton interpreter, smoke run)", 1 << 20
    else:
        props = torch.cuda.get_device_properties(dev)
        l2 = getattr(props, "L2_cache_size", 64 << 20)
        name = f"{props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB"
    say(f"# {name}; torch {torch.__version__}, triton {triton.__version__}; {datetime.datetime.now():%Y-%m-%d %H:%M}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.jobs > 0 and not SMOKE:
        warm(args.jobs, args.sweep)
    if not args.skip_checks:
        say("## checks at the real per-rank shapes (outputs poisoned first)")
        run_checks(dev)
        say(f"## checks: {len(FAILURES)} failed")
    bw = copy_bandwidth()
    say(f"## copy bandwidth {bw / 1e12:.3f} TB/s")
    rows, erows, sweep_rows = [], [], []
    say("## layers")
    for i, (lname, k, n) in enumerate([] if args.elementwise_only else SHAPES):
        guard(f"timing {lname}", bench_layer, lname, k, n, bw, l2, dev, args.sweep, 1000 * (i + 1), rows, sweep_rows)
    say(f"## elementwise at {ELEMENTWISE[0]}x{ELEMENTWISE[1]}")
    guard("timing elementwise", bench_elementwise, bw, l2, dev, args.sweep, erows, sweep_rows)
    table = fmt_table(rows, erows, bw)
    tg = targets(rows, erows)
    text = (f"# {name}\n\n" + table + "\n\n## targets\n" + "\n".join(tg) + "\n\n## check failures\n"
            + ("\n".join(FAILURES) or "none"))
    (out / "bench.md").write_text(text + "\n")
    (out / "bench.json").write_text(json.dumps(dict(copy_bw=bw, rows=rows, elementwise=erows, failures=FAILURES,
                                                    device=name), indent=1, default=str))
    (out / "sweep.txt").write_text("\n".join(sweep_rows + ["", "# log"] + LOG) + "\n")
    print("\n" + text, flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
