"""Check and time the one-row CUDA C GEMV (ternary.kernels.stream_gemv) at the 27B's per-rank shapes, side by side
with the Triton dp4a GEMV it would replace, bf16 cuBLAS and the copy bandwidth (issue 19's M = 1 target: 50 %).

    PYTHONPATH=plugin python -m benchmarks.stream_gemv [--quick] [--out DIR]

On the GPU:
- every configuration of the sweep (words per thread, rows per tile, prefetch, CTAs per SM; `--quick`: the
  default only) against dp4a.gemv_reference (the same integer maths; float32 y, 1e-5) on fresh data, and the
  default also against the float32 layer; the fastest and the default run three more times and must give the
  same bits;
- times, as CUDA-graph replays over weight copies that miss L2: the GEMV alone for every configuration, the
  Triton dp4a GEMV at its default, bf16 cuBLAS; and the served call (`ternary_linear`, W8 not kept, x as the
  adapter passes it) with BONSAI_STREAM_GEMV on (this kernel's default) against off (the dp4a route).
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
from bonsai_vllm.ternary.kernels import dp4a, stream_gemv
from bonsai_vllm.ternary.kernels.stream_gemv import StreamConfig
from bonsai_vllm.ternary.reference import dequantize, signed_block_hadamard

SWEEP = [StreamConfig(c, r, pf, ctas) for c, r in ((1, 8), (1, 16), (1, 32), (2, 4), (2, 8), (2, 16), (4, 4), (4, 8))
         for pf, ctas in itertools.product((False, True), (1, 2, 3, 4, 6, 8))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the default configuration only (no sweep)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--layers", default="", help="comma-separated layer names (default: all six and the LM head)")
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
        x = bk.randn(1, k, device=dev, seed=13)
        act = dp4a.prepare(x)
        want_int = dp4a.gemv_reference(act, packed, scales)[0]
        want = (x.float() @ w_ref.t())[0]
        default = stream_gemv.default_config(n, k)
        configs = [default] if args.quick or name == "lm_head" else list(dict.fromkeys([default, *SWEEP]))
        ok = {}
        for cfg in configs:
            y = torch.full((n,), float("nan"), device=dev)
            r = bk.guard(f"{name} {cfg}", stream_gemv.gemv, act, packed, scales, cfg, out=y)
            if r is None:
                continue
            err = bk.rel(y, want_int)
            if not err < 1e-5:
                failures.append(f"{name} {cfg}: {err:.2e} against dp4a.gemv_reference")
                continue
            ok[cfg] = y.clone()
        if not ok:
            continue
        timed = {cfg: bk.time_graph(lambda i: stream_gemv.gemv(act, tern[i][0], tern[i][1], cfg,
                                                               out=torch.empty(n, device=dev)),
                                    copies, bk.calls_for(8)) for cfg in ok}
        best = min(timed, key=timed.get)
        for cfg in {best, default} & set(ok):
            for _ in range(3):  # deterministic: the same bits every call
                again = stream_gemv.gemv(act, packed, scales, cfg)[0]
                if not torch.equal(again, ok[cfg]):
                    failures.append(f"{name} {cfg}: not deterministic ({bk.rel(again, ok[cfg]):.1e} between calls)")
        err_float = bk.rel(ok.get(default, ok[best]), want)
        if not err_float < 3e-3:
            failures.append(f"{name} {default}: {err_float:.2e} against the float32 layer")
        ws = dp4a.Dp4aWorkspace(dev)
        dcfg = dp4a.default_config(n, k)
        t_dp4a = bk.time_graph(lambda i: dp4a.gemv(act, tern[i][0], tern[i][1], dcfg, ws), copies, bk.calls_for(12))
        # the served call with this kernel (its default) and without (the dp4a route), same x
        sg = None if rotated else signs
        tws = {on: [linear.prepare(p, s, sg, expand_int8=False, stream=on) for p, s in tern] for on in (True, False)}
        t_served = {on: bk.time_graph(lambda i: linear.ternary_linear(x, tws[on][i], rotated=rotated), copies,
                                      bk.calls_for(15)) for on in (True, False)}
        xr = x.float() if rotated else signed_block_hadamard(x.float(), signs, 1024)
        y_served = linear.ternary_linear(x, tws[True][0], rotated=rotated).float()[0]
        err_served = bk.rel(y_served, (xr @ w_ref.t())[0])
        if not err_served < 8e-3:  # bf16 output
            failures.append(f"{name} served stream route: {err_served:.2e}")
        dense = [w_ref.to(torch.bfloat16) for _ in range(bk.n_copies(2 * n * k, l2))]
        t_bf16 = bk.time_graph(lambda i: F.linear(x, dense[i]), len(dense), bk.calls_for(30))
        floor = tern_bytes / bw * 1e6
        rows.append(dict(layer=name, K=k, N=n, best=asdict(best), best_us=timed[best], default=asdict(default),
                         default_us=timed.get(default), dp4a_us=t_dp4a, served_us=t_served[True],
                         served_dp4a_us=t_served[False], bf16_us=t_bf16, floor_us=floor, err=err_float,
                         served_err=err_served, sweep={str(c): t for c, t in timed.items()}))
        bk.say(f"  {name:8s} best {timed[best]:6.2f} µs ({100 * floor / timed[best]:.0f}% of copy bw, {best}); "
               f"default {timed.get(default, float('nan')):6.2f}; dp4a {t_dp4a:6.2f} ({100 * floor / t_dp4a:.0f}%); "
               f"served {t_served[True]:6.2f} vs dp4a route {t_served[False]:6.2f}; bf16 {t_bf16:6.2f}")
        torch.cuda.empty_cache()
    lines = ["| layer | stream µs (best) | % of copy bw | best config | stream µs (default) | % of copy bw | "
             "Triton dp4a µs | % of copy bw | × dp4a (default) | served µs (stream) | served µs (dp4a route) | "
             "× | bf16 µs | × bf16 (served) | error vs float32 (GEMV; served, bf16 out) |", "|" + "---|" * 15]
    for r in rows:
        d = r["default_us"] or float("nan")
        lines.append(f"| {r['layer']} | {r['best_us']:.2f} | {100 * r['floor_us'] / r['best_us']:.0f} | "
                     f"{StreamConfig(**r['best'])} | {d:.2f} | {100 * r['floor_us'] / d:.0f} | {r['dp4a_us']:.2f} | "
                     f"{100 * r['floor_us'] / r['dp4a_us']:.0f} | {r['dp4a_us'] / d:.2f} | {r['served_us']:.2f} | "
                     f"{r['served_dp4a_us']:.2f} | {r['served_dp4a_us'] / r['served_us']:.2f} | {r['bf16_us']:.2f} | "
                     f"{r['bf16_us'] / r['served_us']:.2f} | {r['err']:.1e}; {r['served_err']:.1e} |")
    return bk.report(Path(args.out), "stream-gemv", {"copy_bw": bw, "rows": rows}, lines, failures)


if __name__ == "__main__":
    raise SystemExit(main())
