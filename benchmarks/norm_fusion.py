"""The RMSNorm ahead of a layer fused into its activation prep, against vLLM's norm and then the layer (issue 19;
`make bench-norm`).

    PYTHONPATH=plugin python -m benchmarks.norm_fusion [--out DIR] [--ms 1,2,4,...,64,128,512] [--layers ...]

On a CUDA GPU (sm_90 or later), for the layers a norm feeds (gate_up, qkv, GDN-in; per-rank TP=2 shapes, W8 not
kept, unrotated input with the layer's Hadamard signs, as served) and decode rows M, in one run:
- unfused: vLLM's fused_add_rms_norm (GemmaRMSNorm, as torch.compile makes it inside vLLM: one generated kernel
  here too), then `ternary_linear` on the normed rows (the CUDA C rotation + prep, then the layer's kernel);
- fused: `norm_ternary_linear` (rotate_prep.norm_rotate_prep: add, norm, rotation and prep in one kernel, then the
  layer's kernel; from 65 rows, a prefill chunk, the same kernel's add and norm alone, then the layer's route), which
  BONSAI_FUSED_NORM serves for gate_up and qkv;
- the norm alone and the fused kernel alone, to show where the difference comes from.
Each route is checked first: the fused output against the float32 norm and layer (the route's bound), its new
residual bit for bit against x + residual rounded once. Times are medians of CUDA-graph replays over weight copies
that miss L2 (benchmarks.kernels.time_graph); the last lines are the table for docs/benchmarks.md."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from benchmarks import kernels as bk
from benchmarks.layers import BLOCK, BOUND, served_with_signs
from bonsai_vllm.ternary.reference import signed_block_hadamard

MS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 512]
NORM_FED = ("gate_up", "qkv", "gdn_in")  # the layers whose input is a decoder layer's RMSNorm
EPS = 1e-6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--layers", default=",".join(NORM_FED))
    args = ap.parse_args(argv)
    ms, layers = [int(v) for v in args.ms.split(",")], args.layers.split(",")
    from bonsai_vllm.ternary.kernels import linear, rotate_prep

    dev, out = "cuda", Path(args.out)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    # vLLM's GemmaRMSNorm with a residual, compiled as vLLM's torch.compile compiles it (one generated kernel)
    norm = torch.compile(lambda x, residual, weight: linear.rms_norm(x, residual, weight, EPS, weight_offset=1.0))
    rows, failures = [], []
    for name, k, n in bk.SHAPES:
        if name not in layers:
            continue
        layer = bk.served_copies(n, k, dev, seed=11, l2=l2)
        tws, signs = served_with_signs(layer)
        if signs is None:
            failures.append(f"{name}: K = {k} is not whole {BLOCK}-blocks; no norm feeds it unrotated")
            continue
        for tw in tws:  # the switch as BONSAI_FUSED_NORM would set it at load
            tw.fused_norm = tw.cuda_rotation and rotate_prep.norm_applies(dev, k, BLOCK)
        if not tws[0].fused_norm:
            failures.append(f"{name}: the fused kernel does not apply on this device")
            continue
        weight = (0.1 * bk.randn(k, device=dev, seed=5, dtype=torch.float32)).to(torch.bfloat16)
        for m in ms:
            x = bk.randn(m, k, device=dev, seed=400 + m)
            residual = (4 * bk.randn(m, k, device=dev, seed=500 + m, dtype=torch.float32)).to(torch.bfloat16)
            route = linear.route(m, tws[0])
            # the norm in float32 throughout (rms_norm of float32 rows keeps them float32), then the layer
            normed32, z = linear.rms_norm(x.float(), residual.float(), weight, EPS, weight_offset=1.0)
            want = signed_block_hadamard(normed32, signs, BLOCK) @ layer.w_ref.t()
            y, new_res = linear.norm_ternary_linear(x, residual, weight, EPS, tws[0], weight_offset=1.0)
            err = bk.rel(y, want)
            residual_ok = torch.equal(new_res, z.to(torch.bfloat16))
            if route.path not in BOUND or err > BOUND[route.path] or not residual_ok:
                failures.append(f"{name} M={m} {route}: fused {err:.2e} from float32 (bound "
                                f"{BOUND.get(route.path, 0):.0e}), residual equal: {residual_ok}")
                continue

            def unfused(i):
                normed, _ = norm(x, residual, weight)
                return linear.ternary_linear(normed, tws[i])

            def fused(i):
                return linear.norm_ternary_linear(x, residual, weight, EPS, tws[i], weight_offset=1.0)

            prep = route.path in ("stream", "dp4a", "mma")  # else the add and norm alone

            def fused_kernel(i):
                return rotate_prep.norm_rotate_prep(x, residual, weight, EPS, signs, BLOCK, weight_offset=1.0,
                                                    normed=False, prep=prep)

            norm(x, residual, weight)  # compiled outside the capture
            t_unfused = bk.time_graph(unfused, layer.copies, bk.calls_for(30))
            t_fused = bk.time_graph(fused, layer.copies, bk.calls_for(30))
            t_norm = bk.time_graph(lambda i: norm(x, residual, weight), 1, bk.calls_for(5))
            t_kernel = bk.time_graph(fused_kernel, 1, bk.calls_for(5))
            rows.append(dict(layer=name, K=k, N=n, M=m, route=str(route), err=err, unfused_us=t_unfused,
                             fused_us=t_fused, norm_us=t_norm, fused_kernel_us=t_kernel))
            bk.say(f"  {name:8s} M={m:3d} unfused {t_unfused:7.2f} µs  fused {t_fused:7.2f} "
                   f"({t_unfused / t_fused:.2f}x; {route.path}, err {err:.1e})  norm alone {t_norm:6.2f}  "
                   f"fused kernel alone {t_kernel:6.2f}")
    lines = ["| layer | M | route | unfused µs (norm, then layer) | fused µs | × unfused | error | norm alone µs | "
             "fused kernel alone µs |", "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['M']} | {r['route']} | {r['unfused_us']:.2f} | {r['fused_us']:.2f} | "
                     f"{r['unfused_us'] / r['fused_us']:.2f} | {r['err']:.1e} | {r['norm_us']:.2f} | "
                     f"{r['fused_kernel_us']:.2f} |")
    return bk.report(out, "norm-fusion", {"rows": rows}, lines, failures)


if __name__ == "__main__":
    raise SystemExit(main())
