"""Run the served ternary kernels a few times per (layer, rows) so that Nsight Compute can read their counters.

    ncu --clock-control none -k regex:'ternary_mma|_gemv_kernel' --section WarpStateStats ... \\
        python -m benchmarks.ncu_layers --cases 'gate_up:48 down:16 gate_up:64:4,1,1,0,4,1,1' [--calls 3]

Timing belongs to the benchmarks (CUDA-graph replays over copies that miss L2); this driver only launches
each case's kernels `calls` times, eagerly, on one weight copy and fresh activations, after one checked call
(the output against mma.gemm_reference or the dp4a reference), so a profile is never of a wrong kernel. One
row goes through dp4a, 2-64 rows through mma.gemm with the default configuration or the case's own
(`layer:rows:config`, MmaConfig's fields in order: warps, rtiles, split, residual, stages, gps, wm, ks);
`layer:rows:stream[:words,rows,prefetch,ctas_per_sm]` runs the streaming GEMV (1-2 rows)."""

from __future__ import annotations

import argparse

import torch

from benchmarks import kernels as bk
from bonsai_vllm.ternary.kernels import dp4a, mma, stream_gemv
from bonsai_vllm.ternary.kernels.mma import MmaConfig
from bonsai_vllm.ternary.kernels.stream_gemv import StreamConfig

SHAPES = {name: (k, n) for name, k, n in bk.SHAPES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", required=True, help="layer:rows[:config] separated by spaces or ';' (layers: "
                    + ", ".join(SHAPES) + "; config: warps,rtiles,split,residual,stages,gps,wm)")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    dev = "cuda"
    for case in args.cases.replace(";", " ").split():
        name, m, *config = case.split(":")
        m = int(m)
        k, n = SHAPES[name]
        packed, scales, _ = bk.random_layer(n, k, dev, seed=7)
        x = bk.randn(m, k, device=dev, seed=11 + m)
        act = dp4a.prepare(x)
        ws = dp4a.Dp4aWorkspace(dev)
        if config and config[0] == "stream":  # layer:rows:stream[:words,rows,prefetch,ctas_per_sm]
            if len(config) > 1:
                c, r, pf, ctas = (int(v) for v in config[1].split(","))
                cfg = StreamConfig(c, r, bool(pf), ctas)
            else:
                cfg = stream_gemv.default_config(n, k, m)
            run = lambda: stream_gemv.gemv(act, packed, scales, cfg, early=False)  # noqa: E731
            exact = mma.gemm_reference(act, packed, scales, residual=True)
        elif m == 1:
            cfg = dp4a.default_config(n, k)
            run = lambda: dp4a.gemv(act, packed, scales, cfg, ws)  # noqa: E731
            exact = mma.gemm_reference(act, packed, scales, residual=True)
        else:
            if config:  # the residual field comes as 0 / 1
                warps, rtiles, split, residual, *rest = (int(v) for v in config[0].split(","))
                cfg = MmaConfig(warps, rtiles, split, bool(residual), *rest)
            else:
                cfg = mma.default_config(m, n, k, mma.Gpu.of("cuda"))
            run = lambda: mma.gemm(act, packed, scales, cfg, ws)  # noqa: E731
            exact = mma.gemm_reference(act, packed, scales, residual=cfg.residual)
        err = bk.rel(run(), exact)
        print(f"{name} M={m} {cfg}: {err:.1e} from the integer reference", flush=True)
        if not err < 1e-4:
            return 1
        for _ in range(args.calls):
            run()
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
