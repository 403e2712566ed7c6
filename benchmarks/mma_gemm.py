"""Check and time issue 19's 2-64-row kernel, ternary.kernels.mma (int8 mma.sync on codes decoded in registers).

    PYTHONPATH=plugin python -m benchmarks.mma_gemm [--out DIR] [--ms 1,2,16,48] [--layers gate_up,...] [--quick]

On the GPU, for the six per-rank layers of the 27B and batch rows M:
- every configuration in the sweep (`--quick`: the default alone) against the kernel's own integer maths
  (mma.gemm_reference: must agree to float32 rounding) and against the float32 layer on the same prepared
  activations (the int8 error itself), on fresh random data with a NaN-poisoned output; the fastest re-run
  and required bit-equal;
- times as CUDA-graph replays over weight copies that miss L2: the kernel alone and with its activation prep
  (dp4a.prepare), the route served for M rows (`ternary_linear`, W8 not kept: dp4a at M = 1, this kernel
  at 2-64), bf16 cuBLAS, and the fraction of copy bandwidth each reaches.
`--rtx-occupancy` pads each launch's shared memory so that an H200 SM holds no more CTAs of the instance than an
RTX 50 card's SM would (sm_120's 100 KB of shared memory and 1,536 threads per SM, its own register count): the
H200's 228 KB per SM otherwise ranks configurations by an occupancy the target never has. The SM count (132
against the RTX 5070's 48) is not emulated. The "default" is then the sm_120 rule (mma.default_config's RTX
tables, at this GPU's SM count), timed beside the sm_90 rule. `--sms 48` also runs every timing on 48 SMs (a
CUDA green context), and the rules take 48 SMs: then only the H200's bandwidth and clocks remain.
The last lines are a table (docs/benchmarks.md keeps it) and the list of check failures."""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import kernels as bk
from bonsai_vllm.ternary.kernels import dp4a, mma
from bonsai_vllm.ternary.kernels.mma import MmaConfig

MS = [1, 2, 3, 4, 8, 16, 24, 32, 48, 64]
SHAPES = bk.SHAPES


def sweep(m: int, n: int, k: int, quick: bool, min_shared: int = 0,
          gpus: tuple[mma.Gpu, ...] = (mma.H200,), ks_only: bool = False, flat: bool = False) -> list[MmaConfig]:
    """The configurations timed for m rows: the defaults of the rules for `gpus` alone (`quick`), or the sweep
    the rules came from (warps and row tiles per CTA, warps along the batch and along K, K slices, stages ×
    groups per stage); with `min_shared`, only the sweep's configurations above that many bytes of shared
    memory (and the defaults); with `ks_only`, only those with warps along K (and the defaults); with `flat`, the
    same configurations with each stage's groups branch-free (MmaConfig.flat), and the defaults both ways."""
    defaults = [d for d in dict.fromkeys(mma.default_config(m, n, k, g) for g in gpus) if d is not None]
    if quick:
        return defaults
    residual = (m <= mma.RESIDUAL_MAX_M,)  # the rule's choice: the sweep times the instances it can serve
    # the instance m rows run without batch warps (seven column tiles run eight); batch warps must divide its tiles
    tiles = MmaConfig(4, 1, 1, False).tiles(m)
    layouts = [(w, r, 1, 1) for w, r in ((2, 1), (4, 1), (4, 2), (8, 1))]  # (2, 1): 32-row CTAs, twice the CTAs
    layouts += [(4, r, wm, 1) for r in (1, 2) for wm in (2, 3, 4)]
    # warps along K inside the CTA (each takes every ks-th group of a stage): more warps per SM on the same tiles
    layouts += [(w, 1, wm, ks) for w in (2, 4) for wm in (1, 2, 3) for ks in (2, 4)]
    pipes = ((4, 1), (6, 1), (8, 1), (3, 2), (4, 2), (5, 2), (2, 4), (3, 4))  # (stages, groups per stage)
    cands = [c for c in (MmaConfig(w, r, s, res, st, gps, wm, ks) for w, r, wm, ks in layouts for s in (1, 2, 4, 8)
                         for res in residual for st, gps in pipes)
             if c.tiles(m) == tiles and c.fits(tiles) and c.shared_bytes(tiles) > min_shared
             and (c.ks > 1 or not ks_only)]
    if flat:
        cands = [replace(c, flat=True) for c in cands] + [replace(d, flat=not d.flat) for d in defaults]
    cands += [d for d in defaults if d not in cands]
    return [c for c in cands if n % c.rows_per_cta() == 0 and (k // 128) // c.split >= 2]


def rtx_shared(m: int, config: MmaConfig) -> int | None:
    """The dynamic shared memory at which an H200 SM holds as many CTAs of this instance as an sm_120 SM would
    (registers of each target's own build, from cuobjdump), or None where it holds no more already."""
    from tools.compile_check import ctas_per_sm, resources, shared_for_ctas

    name = mma.template(m, config, torch.float32)
    threads = config.threads()
    dynamic = config.shared_bytes(config.tiles(m))
    held = {}
    for target in (90, 120):
        res = resources(mma.compile_instance(name, str(target))[0])
        held[target] = (ctas_per_sm(target, threads, res.registers, res.static_shared + dynamic), res.static_shared)
    (h200, static), (rtx, _) = held[90], held[120]
    if rtx >= h200:
        return None
    return max(dynamic, shared_for_ctas(90, max(rtx, 1)) - static)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--layers", default=",".join(s[0] for s in SHAPES), help="layers, comma-separated")
    ap.add_argument("--quick", action="store_true", help="the default configuration only (no sweep)")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds of checks and timings, then the table")
    ap.add_argument("--rtx-occupancy", action="store_true",
                    help="pad shared memory so an H200 SM holds as many CTAs as an sm_120 SM would")
    ap.add_argument("--sms", type=int, default=0,
                    help="time on this many SMs (a green context; with --rtx-occupancy: 48 for the RTX 5070)")
    ap.add_argument("--min-shared", type=int, default=0,
                    help="sweep only configurations above this many bytes of shared memory (and the default)")
    ap.add_argument("--ks-only", action="store_true",
                    help="sweep only configurations with warps along K inside the CTA (and the default)")
    ap.add_argument("--flat", action="store_true",
                    help="sweep the configurations with each stage's groups branch-free (and the default both ways)")
    args = ap.parse_args(argv)
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [s for s in SHAPES if s[0] in args.layers.split(",")]
    from bonsai_vllm.ternary.kernels import linear

    dev = "cuda"
    # The rule timed as "default": this GPU's own, or with --rtx-occupancy the sm_120 tables on this GPU's SMs
    # (the sm_90 rule is timed beside it).
    gpus = (mma.Gpu.of(dev, "sm120"), mma.Gpu.of(dev, "sm90")) if args.rtx_occupancy else (mma.Gpu.of(dev),)
    if args.sms:
        bk.on_sms(args.sms)
        gpus = tuple(replace(g, sms=args.sms) for g in gpus)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Compile every instance the sweep needs at once (NVRTC on the host's cores), not one by one inside timing.
    t0 = time.time()
    wanted = {mma.template(m, c, dt): (m, c, dt) for name, k, n in shapes for m in ms
              for c in sweep(m, n, k, args.quick, args.min_shared, gpus, args.ks_only, args.flat)
              for dt in (torch.bfloat16, torch.float32)}
    cap = "".join(map(str, torch.cuda.get_device_capability()))
    # With --rtx-occupancy the sm_120 builds too: their register counts set each launch's padding.
    builds = [(name, c) for name in sorted(wanted) for c in ([cap, "120"] if args.rtx_occupancy else [cap])]
    with ThreadPoolExecutor(16) as pool:  # NVRTC on the host's cores; the modules load in this thread
        list(pool.map(lambda b: mma.compile_instance(*b), builds))
    for a in wanted.values():
        mma.kernel(*a, torch.device(dev))
    bk.say(f"compiled {len(wanted)} instances in {time.time() - t0:.1f} s")
    deadline = time.time() + args.budget

    bw = bk.copy_bandwidth()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    rows, failures = [], []
    for name, k, n in shapes:
        layer = bk.served_copies(n, k, dev, seed=5, l2=l2)  # today's served routes, x rotated
        packed, scales, w_ref, tern, tws, dense = (layer.packed, layer.scales, layer.w_ref, layer.tern, layer.served,
                                                   layer.dense)
        copies = layer.copies
        ws = dp4a.Dp4aWorkspace(dev)
        floor = layer.nbytes / bw * 1e6
        for m in ms:
            if time.time() > deadline:
                failures.append(f"{name} M={m}: not run (--budget spent)")
                continue
            x = bk.randn(m, k, device=dev, seed=100 + m)  # taken as rotated
            act = dp4a.prepare(x)
            want = x.float() @ w_ref.t()
            ok = []
            exact_for = {res: mma.gemm_reference(act, packed, scales, res) for res in (True, False)}
            for cfg in sweep(m, n, k, args.quick, args.min_shared, gpus, args.ks_only, args.flat):
                exact = exact_for[cfg.residual]
                try:
                    y = mma.gemm(act, packed, scales, cfg, ws, out=torch.full((m, n), float("nan"), device=dev))
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - a failing config is reported, the sweep goes on
                    failures.append(f"{name} M={m} {cfg}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                e_exact, e_ref = bk.rel(y, exact), bk.rel(y, want)
                if not (torch.isfinite(y).all() and e_exact < 1e-5):
                    failures.append(f"{name} M={m} {cfg}: {e_exact:.2e} from its own integer maths "
                                    f"({e_ref:.2e} from float32)")
                    continue
                ok.append((cfg, e_ref, y.clone()))
            if not ok:
                continue
            pad = {c: rtx_shared(m, c) if args.rtx_occupancy else None for c, _, _ in ok}
            timed = {c: bk.time_graph(lambda i, c=c: mma.gemm(act, tern[i][0], tern[i][1], c, ws, shared_mem=pad[c]),
                                      copies, bk.calls_for(15)) for c, _, _ in ok}
            best = min(timed, key=timed.get)
            err, first = next((e, y) for c, e, y in ok if c == best)
            for _ in range(3):
                again = mma.gemm(act, packed, scales, best, ws)
                if not torch.equal(again, first):
                    failures.append(f"{name} M={m} {best}: not deterministic ({bk.rel(again, first):.1e})")
            fast = {res: min((t for c, t in timed.items() if c.residual == res), default=float("nan"))
                    for res in (True, False)}
            default, sm90 = mma.default_config(m, n, k, gpus[0]), mma.default_config(m, n, k, gpus[-1])
            t_default, t_sm90 = timed.get(default, float("nan")), timed.get(sm90, float("nan"))
            yb = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            t_prep = bk.time_graph(lambda i: mma.gemm(dp4a.prepare(x, out=act), tern[i][0], tern[i][1], best, ws,
                                                      out=yb), copies, bk.calls_for(15))
            t_today = bk.time_graph(lambda i: linear.ternary_linear(x, tws[i], rotated=True), copies,
                                    bk.calls_for(30))
            t_bf16 = bk.time_graph(lambda i: F.linear(x, dense[i]), len(dense), bk.calls_for(30))
            row = dict(layer=name, K=k, N=n, M=m, sms=gpus[0].sms, rtx_occupancy=args.rtx_occupancy,
                       best=asdict(best), best_us=timed[best], err=err,
                       residual_us=fast[True], plain_us=fast[False], default=str(default), default_us=t_default,
                       sm90_default_us=t_sm90,
                       with_prep_us=t_prep, today_us=t_today, today_route=str(linear.route(m, tws[0])),
                       bf16_us=t_bf16, floor_us=floor, all={str(c): t for c, t in timed.items()})
            rows.append(row)
            bk.say(f"  {name:8s} M={m:3d} mma {timed[best]:7.2f} µs ({best}, err {err:.1e}; residual "
                   f"{fast[True]:.2f} plain {fast[False]:.2f}; default {t_default:.2f}, sm90's {t_sm90:.2f}) +prep {t_prep:7.2f}  "
                   f"today {t_today:7.2f}  bf16 {t_bf16:7.2f}  floor {floor:5.2f}")
            (out / "mma-gemm.json").write_text(json.dumps({"rows": rows, "failures": failures}, indent=1))
    lines = ["| layer | M | mma µs | + prep µs | today µs (route) | × today | bf16 µs | × bf16 (with prep) | "
             "% of copy bw | residual / plain µs | error vs float32 | best config |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['M']} | {r['best_us']:.2f} | {r['with_prep_us']:.2f} | "
                     f"{r['today_us']:.2f} ({r['today_route'].split(' bm=')[0]}) | "
                     f"{r['today_us'] / r['with_prep_us']:.2f} | {r['bf16_us']:.2f} | "
                     f"{r['bf16_us'] / r['with_prep_us']:.2f} | {100 * r['floor_us'] / r['best_us']:.0f} | "
                     f"{r['residual_us']:.2f} / {r['plain_us']:.2f} | {r['err']:.1e} | {MmaConfig(**r['best'])} |")
    return bk.report(out, "mma-gemm", {"rows": rows}, lines, failures)


if __name__ == "__main__":
    raise SystemExit(main())
