"""Check and time issue 19's M = 1 candidate, ternary.kernels.dp4a, at the 27B's six per-rank shapes.

    PYTHONPATH=plugin python -m benchmarks.dp4a_gemv [--out DIR]

The kernel, its activation prep and its deterministic split-K are in plugin/bonsai_vllm/ternary/kernels/dp4a.py
(the maths in its docstring; tests/core/test_dp4a.py compares it with its torch references on CPU). Here, on
the GPU, with compiled PTX dp4a:

- every configuration against the float32 layer (ternary.reference.dequantize) on fresh data; the chosen one
  run three more times and required bit-equal (split-K must be deterministic);
- times, as CUDA-graph replays over weight copies that miss L2 (the prep runs on the device, so the
  whole call is captured): the GEMV alone, prep + GEMV, the served call at M = 1 (`ternary_linear`, W8
  not kept, x as the adapter passes it: unrotated, so rotation + prep are one kernel, except down_proj's
  rotated x; what BONSAI_DP4A_GEMV=1, the default, serves), the fma route it replaced
  (BONSAI_DP4A_GEMV=0, the same x) and bf16 cuBLAS; and the fraction of copy bandwidth each reaches. The LM head (5120 → 124160 per rank) runs at the default config only (no sweep: its weights
  are 160 MB a copy). docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import kernels as bk
from bonsai_vllm.ternary.kernels import dp4a
from bonsai_vllm.ternary.kernels.dp4a import Dp4aConfig
from bonsai_vllm.ternary.reference import dequantize, signed_block_hadamard

CONFIGS = [Dp4aConfig(bn, bw, w, s, sp) for bn in (4, 8, 16, 32) for bw in (16, 32) for w in (1, 2, 4) for s in (2, 3)
           for sp in (1, 2, 4, 8) if 64 <= bn * bw <= 1024]
# Several rows per call (M = 2 is one user's decode step with MTP on: the token and its draft). Three and
# four rows lost to the served routes at every shape (the run of commit 2b1628e, docs/benchmarks.md):
# dp4a work grows with the rows while the tensor-core GEMV's does not.
MULTI_ROWS = [2]
ROW_CONFIGS = [Dp4aConfig(bn, 32, w, 2, sp) for bn in (8, 16, 32) for w in (1, 2, 4) for sp in (2, 4, 8)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    from bonsai_vllm.ternary.kernels import linear

    # the served call with the dp4a route up to the most rows the kernel takes, whatever the dispatch's
    # threshold is today: the table below is what sets it
    linear.DP4A_MAX_M = dp4a.MAX_ROWS
    multi: list[dict] = []

    dev = "cuda"
    bw = bk.copy_bandwidth()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    rows, failures = [], []
    for name, k, n in bk.SHAPES + [("lm_head", 5120, 124160)]:
        packed, scales, signs = bk.random_layer(n, k, dev, seed=3)
        # The served call as the adapter makes it: x unrotated (rotation and prep in one kernel), except for
        # down_proj, whose TP=2 rank cuts a Hadamard block and gets x rotated (prep alone).
        rotated = k % 1024 != 0
        w_ref = dequantize(packed, scales, 128)
        tern_bytes = n * k / 4 + n * k / 128 * 2
        copies = bk.n_copies(int(tern_bytes), l2)
        tern = [(packed.clone(), scales.clone()) for _ in range(copies)]
        sg = None if rotated else signs
        tws = [linear.prepare(p, s, sg, expand_int8=False, dp4a=False) for p, s in tern]  # the fma GEMV
        tws_dp4a = [linear.prepare(p, s, sg, expand_int8=False, dp4a=True) for p, s in tern]  # served now
        dense = [w_ref.to(torch.bfloat16) for _ in range(bk.n_copies(2 * n * k, l2))]
        x = bk.randn(1, k, device=dev, seed=11)
        act = dp4a.prepare(x)
        ws = dp4a.Dp4aWorkspace(dev)
        want = (x.float() @ w_ref.t())[0]
        ok = []
        for cfg in (CONFIGS if name != "lm_head" else [dp4a.default_config(n, k)]):
            if (k // 16) % cfg.bw:
                continue
            try:
                y = dp4a.gemv(act, packed, scales, cfg, ws, out=torch.full((n,), float("nan"), device=dev))
            except Exception as e:
                bk.say(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            err = bk.rel(y, want)
            if not (torch.isfinite(y).all() and err < 3e-3):
                failures.append(f"{name} {cfg}: {err:.2e}")
                continue
            ok.append((cfg, err, y.clone()))
        if not ok:
            continue
        timed = {cfg: bk.time_graph(lambda i: dp4a.gemv(act, tern[i][0], tern[i][1], cfg, ws), copies, bk.calls_for(10))
                 for cfg, _, _ in ok}
        best = min(timed, key=timed.get)
        err, first = next((e, y) for c, e, y in ok if c == best)
        for _ in range(3):  # deterministic: the same bits every call
            again = dp4a.gemv(act, packed, scales, best, ws)
            if not torch.equal(again, first):
                failures.append(f"{name} {best}: not deterministic ({bk.rel(again, first):.1e} between calls)")
        t_both = bk.time_graph(lambda i: dp4a.gemv(dp4a.prepare(x, out=act), tern[i][0], tern[i][1], best, ws),
                               copies, bk.calls_for(12))
        t_prep = bk.time_graph(lambda i: dp4a.prepare(x, out=act), 1, bk.calls_for(3))
        t_served = bk.time_graph(lambda i: linear.ternary_linear(x, tws[i], rotated=rotated), copies,
                                 bk.calls_for(15))
        t_served_dp4a = bk.time_graph(lambda i: linear.ternary_linear(x, tws_dp4a[i], rotated=rotated), copies,
                                      bk.calls_for(15))
        y_served = linear.ternary_linear(x, tws_dp4a[0], rotated=rotated).float()[0]
        xr = x.float() if rotated else signed_block_hadamard(x.float(), signs, 1024)
        err_served = bk.rel(y_served, (xr @ w_ref.t())[0])
        if not (torch.isfinite(y_served).all() and err_served < 8e-3):  # the bf16 output of the served call
            failures.append(f"{name} served dp4a route: {err_served:.2e}")
        t_bf16 = bk.time_graph(lambda i: F.linear(x, dense[i]), len(dense), bk.calls_for(30))
        floor = tern_bytes / bw * 1e6
        rows.append(dict(layer=name, K=k, N=n, dp4a_us=timed[best], with_prep_us=t_both, prep_us=t_prep,
                         config=asdict(best), err=err, served_us=t_served, served_dp4a_us=t_served_dp4a,
                         served_err=err_served, rotated=rotated,
                         served_dp4a_config=str(tws_dp4a[0].dp4a[0]), bf16_us=t_bf16, floor_us=floor))
        bk.say(f"  {name:8s} dp4a {timed[best]:6.2f} µs ({100 * floor / timed[best]:.0f}% of copy bw, {best}, "
               f"err {err:.1e}), with prep {t_both:6.2f}  served dp4a {t_served_dp4a:6.2f}  "
               f"fma {t_served:6.2f} ({100 * floor / t_served:.0f}%)  bf16 {t_bf16:6.2f}")
        for m in MULTI_ROWS:
            multi.append(bench_rows(name, k, n, m, rotated, signs, w_ref, tern, tws, tws_dp4a, dense, ws, copies,
                                    floor, failures, linear))
    lines = ["| layer | dp4a µs | % of copy bw | prep + dp4a µs | served (dp4a) µs | served fma µs | × fma | "
             "% of copy bw (served) | bf16 µs | × bf16 (served) | error vs float32 (GEMV; served, bf16 out) | "
             "best config | served config |", "|" + "---|" * 13]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['dp4a_us']:.2f} | {100 * r['floor_us'] / r['dp4a_us']:.0f} | "
                     f"{r['with_prep_us']:.2f} | {r['served_dp4a_us']:.2f} | {r['served_us']:.2f} | "
                     f"{r['served_us'] / r['served_dp4a_us']:.2f} | {100 * r['floor_us'] / r['served_dp4a_us']:.0f} | "
                     f"{r['bf16_us']:.2f} | {r['bf16_us'] / r['served_dp4a_us']:.2f} | {r['err']:.1e}; {r['served_err']:.1e} | "
                     f"{Dp4aConfig(**r['config'])} | {r['served_dp4a_config']} |")
    lines += ["", "| layer | M | dp4a GEMV µs (best config) | served dp4a µs | served today µs | × today | "
              "bf16 µs | × bf16 (served dp4a) | % of copy bw (served dp4a) | error vs float32 (served, bf16 out) | "
              "best config | default config | today's route |", "|" + "---|" * 13]
    for r in multi:
        lines.append(f"| {r['layer']} | {r['M']} | {r['gemv_us']:.2f} | {r['served_dp4a_us']:.2f} | "
                     f"{r['today_us']:.2f} | {r['today_us'] / r['served_dp4a_us']:.2f} | {r['bf16_us']:.2f} | "
                     f"{r['bf16_us'] / r['served_dp4a_us']:.2f} | {100 * r['floor_us'] / r['served_dp4a_us']:.0f} | "
                     f"{r['err']:.1e} | {r['best']} | {r['default']} | {r['today_route']} |")
    return bk.report(Path(args.out), "dp4a-gemv", {"rows": rows, "multi": multi}, lines, failures)


def bench_rows(name, k, n, m, rotated, signs, w_ref, tern, tws, tws_dp4a, dense, ws, copies, floor, failures,
               linear) -> dict:
    """M rows: the GEMV over ROW_CONFIGS (checked first), then the served call with the dp4a route (default
    config) against today's route for M rows (BONSAI_DP4A_GEMV=0's) and bf16 cuBLAS."""
    dev = "cuda"
    x = bk.randn(m, k, device=dev, seed=20 + m)
    act = dp4a.prepare(x)  # the GEMV alone: x taken as rotated
    want = x.float() @ w_ref.t()
    ok = []
    for cfg in ROW_CONFIGS:
        y = dp4a.gemv(act, tern[0][0], tern[0][1], cfg, ws, out=torch.full((m, n), float("nan"), device=dev))
        err = bk.rel(y, want)
        if torch.isfinite(y).all() and err < 3e-3:
            ok.append(cfg)
        else:
            failures.append(f"{name} M={m} {cfg}: {err:.2e}")
    timed = {cfg: bk.time_graph(lambda i: dp4a.gemv(act, tern[i][0], tern[i][1], cfg, ws), copies, bk.calls_for(15))
             for cfg in ok}
    best = min(timed, key=timed.get) if timed else None
    xr = x.float() if rotated else signed_block_hadamard(x.float(), signs, 1024)
    y = linear.ternary_linear(x, tws_dp4a[0], rotated=rotated).float()
    err = bk.rel(y, xr @ w_ref.t())
    if not (torch.isfinite(y).all() and err < 8e-3):
        failures.append(f"{name} M={m} served dp4a route: {err:.2e}")
    t_dp4a = bk.time_graph(lambda i: linear.ternary_linear(x, tws_dp4a[i], rotated=rotated), copies, bk.calls_for(20))
    t_today = bk.time_graph(lambda i: linear.ternary_linear(x, tws[i], rotated=rotated), copies, bk.calls_for(30))
    t_bf16 = bk.time_graph(lambda i: F.linear(x, dense[i]), len(dense), bk.calls_for(30))
    bk.say(f"  {name:8s} M={m} dp4a GEMV {timed.get(best, float('nan')):6.2f} µs ({best}), served dp4a "
           f"{t_dp4a:6.2f} ({linear.route(m, tws_dp4a[0])}), today {t_today:6.2f}, bf16 {t_bf16:6.2f}, err {err:.1e}")
    return dict(layer=name, M=m, gemv_us=timed.get(best, float("nan")), best=str(best), served_dp4a_us=t_dp4a,
                default=str(linear.route(m, tws_dp4a[0]).config), today_us=t_today,
                today_route=str(linear.route(m, tws[0])), bf16_us=t_bf16, err=err, floor_us=floor)


if __name__ == "__main__":
    raise SystemExit(main())
