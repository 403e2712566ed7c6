"""Check and time the streaming CUDA C GEMV (ternary.kernels.stream_gemv) at one and two rows and the 27B's per-rank
shapes, side by side with the routes it would replace, bf16 cuBLAS and the copy bandwidth (issue 19's M = 1
target: 50 %).

    PYTHONPATH=plugin python -m benchmarks.stream_gemv [--quick] [--out DIR]

On the GPU:
- every configuration of the sweep (words per thread, rows per tile, prefetch, CTAs per SM; `--quick`: the
  default only) against dp4a.gemv_reference (the same integer maths; float32 y, 1e-5) on fresh data, and the
  default also against the float32 layer; the fastest and the default run three more times and must give the
  same bits;
- times, as CUDA-graph replays over weight copies that miss L2: the GEMV alone for every configuration
  (ordinary launches), bf16 cuBLAS, and the served call (`ternary_linear`, W8 not kept, x as the adapter passes
  it: prep + GEMV) with BONSAI_STREAM_GEMV on (the GEMV launched early, and the ordinary way) against off
  (today's routes: the dp4a GEMV at one row, the mma kernel at two).
docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import itertools
import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import kernels as bk
from bonsai_vllm import nvrtc
from bonsai_vllm.ternary.kernels import dp4a, stream_gemv
from bonsai_vllm.ternary.kernels.stream_gemv import StreamConfig
from bonsai_vllm.ternary.reference import dequantize, signed_block_hadamard

HEAD_SWEEP = [StreamConfig(2, r, pf, ctas) for r in (4, 8) for pf in (False, True) for ctas in (2, 4, 6)]
ROWS = (1, 2, 4)  # one user's decode step without and with MTP; two users with MTP (or four without)

# What any one-kernel GEMV on this grid pays before arithmetic: `read_floor` reads a layer's codes and scales with
# the streaming GEMV's CTAs, rows and words per thread (two words, eight rows of loads in flight) and keeps only an
# XOR; `launch_floor` is the same grid doing nothing. Both are timed like the GEMV (graph replays, copies that miss
# L2), so the GEMV's time over read_floor's is what its arithmetic, reduction and stores cost.
FLOOR_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
template <int KW>
__global__ void read_floor(const u64* __restrict__ codes, const unsigned short* __restrict__ scales, int N, u32* sink) {
  const long r0 = (long)blockIdx.x * N / gridDim.x, r1 = (long)(blockIdx.x + 1) * N / gridDim.x;
  const int t = threadIdx.x;
  const bool active = 2 * t < KW;
  u32 acc = 0;
  for (long n0 = r0; n0 < r1; n0 += 8) {
    u64 w[8];
    unsigned short sc[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const bool ok = active && n0 + r < r1;
      w[r] = ok ? __ldg(codes + (n0 + r) * (KW / 2) + t) : 0ull;
      sc[r] = ok ? __ldg(scales + (n0 + r) * (KW / 8) + t / 4) : (unsigned short)0;
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) acc ^= (u32)w[r] ^ (u32)(w[r] >> 32) ^ sc[r];
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;  // (almost) never: only keeps the loads
}
__global__ void launch_floor(u32* sink) {
  if (threadIdx.x == 1023) sink[0] = 1;
}
"""


def floor_kernels(k: int):
    """(read_floor for K inputs, launch_floor), compiled for this GPU."""
    major, minor = torch.cuda.get_device_capability()
    return tuple(nvrtc.load(*nvrtc.compile_cuda(FLOOR_SOURCE, name, f"{major}{minor}"), torch.cuda.current_device())
                 for name in (f"read_floor<{k // 16}>", "launch_floor"))


def time_floors(k: int, n: int, tern, copies: int) -> tuple[float, float]:
    """µs per call of read_floor and launch_floor on the one-row default's grid."""
    config = stream_gemv.default_config(n, k, 1)
    ctas, _ = stream_gemv.grid(config, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    block = (32 * config.warps(k), 1, 1)
    read, empty = floor_kernels(k)
    sink = torch.zeros(ctas, dtype=torch.int32, device="cuda")
    t_read = bk.time_graph(lambda i: read(grid=(ctas, 1, 1), block=block, args=[tern[i][0], tern[i][1], n, sink]),
                           copies, bk.calls_for(5))
    t_empty = bk.time_graph(lambda i: empty(grid=(ctas, 1, 1), block=block, args=[sink]), 1, bk.calls_for(2))
    return t_read, t_empty  # one user's decode step without and with MTP
SWEEP = [StreamConfig(c, r, pf, ctas) for c, r in ((1, 8), (1, 16), (1, 32), (2, 4), (2, 8), (2, 16), (4, 4), (4, 8))
         for pf, ctas in itertools.product((False, True), (1, 2, 3, 4, 6, 8))]


def bench_rows(name, k, n, m, rotated, signs, packed, scales, w_ref, tern, tws, dense, copies, floor, quick, failures,
               linear) -> dict | None:
    dev = packed.device
    x = bk.randn(m, k, device=dev, seed=13 + m)
    act = dp4a.prepare(x)
    want_int = dp4a.gemv_reference(act, packed, scales)
    want = x.float() @ w_ref.t()
    default = stream_gemv.default_config(n, k, m) or StreamConfig(2, 4, False, 4)  # four rows: not served yet
    sweep = HEAD_SWEEP if name == "lm_head" else SWEEP
    configs = [default] if quick else list(dict.fromkeys([default, *sweep]))
    ok = {}
    for cfg in configs:
        if m * cfg.rows > 32:
            continue
        y = torch.full((m, n), float("nan"), device=dev)
        if bk.guard(f"{name} M={m} {cfg}", stream_gemv.gemv, act, packed, scales, cfg, out=y) is None:
            continue
        err = bk.rel(y, want_int)
        if not err < 1e-5:
            failures.append(f"{name} M={m} {cfg}: {err:.2e} against dp4a.gemv_reference")
            continue
        ok[cfg] = y.clone()
    if not ok:
        return None
    # ordinary launches here (one GEMV after another, as the kernel alone runs)
    timed = {cfg: bk.time_graph(lambda i: stream_gemv.gemv(act, tern[i][0], tern[i][1], cfg,
                                                           out=torch.empty(m, n, device=dev), early=False),
                                copies, bk.calls_for(8)) for cfg in ok}
    best = min(timed, key=timed.get)
    for cfg in {best, default} & set(ok):
        for _ in range(3):  # deterministic: the same bits every call
            again = stream_gemv.gemv(act, packed, scales, cfg)
            if not torch.equal(again, ok[cfg]):
                failures.append(f"{name} M={m} {cfg}: not deterministic ({bk.rel(again, ok[cfg]):.1e} between calls)")
    err_float = bk.rel(ok.get(default, ok[best]), want)
    if not err_float < 3e-3:
        failures.append(f"{name} M={m} {default}: {err_float:.2e} against the float32 layer")

    def served(on: bool):
        return bk.time_graph(lambda i: linear.ternary_linear(x, tws[on][i], rotated=rotated), copies, bk.calls_for(15))

    t_served, t_today = served(True), served(False)
    stream_gemv.EARLY_LAUNCH = False  # the same served call, the GEMV launched the ordinary way
    t_served_late = served(True)
    stream_gemv.EARLY_LAUNCH = True
    xr = x.float() if rotated else signed_block_hadamard(x.float(), signs, 1024)
    y_served = linear.ternary_linear(x, tws[True][0], rotated=rotated).float()
    err_served = bk.rel(y_served, xr @ w_ref.t())
    if not err_served < 8e-3:  # bf16 output
        failures.append(f"{name} M={m} served stream route: {err_served:.2e}")
    t_bf16 = bk.time_graph(lambda i: F.linear(x, dense[i]), len(dense), bk.calls_for(30))
    today = str(linear.route(m, tws[False][0]))
    bk.say(f"  {name:8s} M={m} best {timed[best]:6.2f} µs ({100 * floor / timed[best]:.0f}% of copy bw, {best}); "
           f"default {timed.get(default, float('nan')):6.2f}; served {t_served:6.2f} (ordinary launch "
           f"{t_served_late:6.2f}) vs today {t_today:6.2f} ({today}); bf16 {t_bf16:6.2f}")
    return dict(layer=name, K=k, N=n, M=m, best=asdict(best), best_us=timed[best], default=asdict(default),
                default_us=timed.get(default), served_us=t_served, served_late_us=t_served_late, today_us=t_today,
                today=today, bf16_us=t_bf16, floor_us=floor, err=err_float, served_err=err_served,
                sweep={str(c): t for c, t in timed.items()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the default configuration only (no sweep)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--layers", default="", help="comma-separated layer names (default: all six and the LM head)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="batch rows, of 1, 2, 4")
    args = ap.parse_args(argv)
    from bonsai_vllm.ternary.kernels import linear

    dev = "cuda"
    bw = bk.copy_bandwidth()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    rows, failures = [], []
    shapes = bk.SHAPES + [("lm_head", 5120, 124160)]
    if args.layers:
        shapes = [s for s in shapes if s[0] in args.layers.split(",")]
    for name, k, n in shapes:
        packed, scales, signs = bk.random_layer(n, k, dev, seed=5)
        rotated = k % 1024 != 0  # down_proj's rank cuts a Hadamard block: the adapter passes x rotated
        w_ref = dequantize(packed, scales, 128)
        tern_bytes = n * k / 4 + n * k / 128 * 2
        copies = bk.n_copies(int(tern_bytes), l2)
        tern = [(packed.clone(), scales.clone()) for _ in range(copies)]
        sg = None if rotated else signs
        # the served layer with this kernel (its defaults) and without (today's routes: dp4a at one row, mma at two)
        tws = {on: [linear.prepare(p, s, sg, expand_int8=False, stream=on) for p, s in tern] for on in (True, False)}
        dense = [w_ref.to(torch.bfloat16) for _ in range(bk.n_copies(2 * n * k, l2))]
        floors = bk.guard(f"{name} floors", time_floors, k, n, tern, copies) or (float("nan"), float("nan"))
        bk.say(f"  {name:8s} read floor {floors[0]:6.2f} µs ({100 * tern_bytes / bw * 1e6 / floors[0]:.0f}% of copy bw), "
               f"launch floor {floors[1]:5.2f} µs")
        for m in (int(v) for v in args.rows.split(",")):
            r = bk.guard(f"{name} M={m}", bench_rows, name, k, n, m, rotated, signs, packed, scales, w_ref,
                         tern, tws, dense, copies, tern_bytes / bw * 1e6, args.quick, failures, linear)
            if r:
                rows.append({**r, "read_floor_us": floors[0], "launch_floor_us": floors[1]})
        del tws, dense
        torch.cuda.empty_cache()
    lines = ["| layer | M | stream µs (best) | % of copy bw | best config | stream µs (default) | % of copy bw | "
             "served µs (stream, early launch) | % of copy bw | served µs, ordinary launch | served µs today | "
             "today's route | × today | bf16 µs | × bf16 (served) | error vs float32 (GEMV; served, bf16 out) | "
             "read floor µs (% of copy bw) | stream (default) × read floor | launch floor µs |", "|" + "---|" * 19]
    for r in rows:
        d = r["default_us"] or float("nan")
        lines.append(f"| {r['layer']} | {r['M']} | {r['best_us']:.2f} | {100 * r['floor_us'] / r['best_us']:.0f} | "
                     f"{StreamConfig(**r['best'])} | {d:.2f} | {100 * r['floor_us'] / d:.0f} | {r['served_us']:.2f} | "
                     f"{100 * r['floor_us'] / r['served_us']:.0f} | {r['served_late_us']:.2f} | {r['today_us']:.2f} | "
                     f"{r['today']} | {r['today_us'] / r['served_us']:.2f} | {r['bf16_us']:.2f} | "
                     f"{r['bf16_us'] / r['served_us']:.2f} | {r['err']:.1e}; {r['served_err']:.1e} | "
                     f"{r['read_floor_us']:.2f} ({100 * r['floor_us'] / r['read_floor_us']:.0f}) | "
                     f"{d / r['read_floor_us']:.2f} | {r['launch_floor_us']:.2f} |")
    return bk.report(Path(args.out), "stream-gemv", {"copy_bw": bw, "rows": rows}, lines, failures)


if __name__ == "__main__":
    raise SystemExit(main())
