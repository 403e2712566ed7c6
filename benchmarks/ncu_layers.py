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


def resolve(case: str, gpu: mma.Gpu) -> tuple[str, int, str, object]:
    """(layer, rows, kernel, configuration) of one `layer:rows[:config]` case; SystemExit naming the case where
    the layer is unknown or the kernel has no configuration there, so a profile never stops halfway."""
    name, m, *config = case.split(":")
    if name not in SHAPES:
        raise SystemExit(f"ncu_layers: case {case!r}: unknown layer {name!r} (layers: {', '.join(SHAPES)})")
    m = int(m)
    k, n = SHAPES[name]
    if config and config[0] == "stream":  # layer:rows:stream[:words,rows,prefetch,ctas_per_sm]
        if len(config) > 1:
            c, r, pf, ctas = (int(v) for v in config[1].split(","))
            kind, cfg = "stream", StreamConfig(c, r, bool(pf), ctas)
        else:
            kind, cfg = "stream", stream_gemv.default_config(n, k, m)
    elif m == 1:
        kind, cfg = "dp4a", dp4a.default_config(n, k)
    elif config:  # the residual field comes as 0 / 1
        warps, rtiles, split, residual, *rest = (int(v) for v in config[0].split(","))
        kind, cfg = "mma", MmaConfig(warps, rtiles, split, bool(residual), *rest)
    else:
        kind, cfg = "mma", mma.default_config(m, n, k, gpu)
    if cfg is None:
        raise SystemExit(f"ncu_layers: case {case!r}: the {kind} kernel has no default configuration for {name} at "
                         f"{m} rows (the served route takes another kernel there); give one in the case")
    return name, m, kind, cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", required=True, help="layer:rows[:config] separated by spaces or ';' (layers: "
                    + ", ".join(SHAPES) + "; config: warps,rtiles,split,residual,stages,gps,wm)")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    dev = "cuda"
    gpu = mma.Gpu.of(dev)
    cases = [resolve(case, gpu) for case in args.cases.replace(";", " ").split()]  # all before the first launch
    for name, m, kind, cfg in cases:
        k, n = SHAPES[name]
        packed, scales, _ = bk.random_layer(n, k, dev, seed=7)
        x = bk.randn(m, k, device=dev, seed=11 + m)
        act = dp4a.prepare(x)
        ws = dp4a.Dp4aWorkspace(dev)
        if kind == "stream":
            run = lambda: stream_gemv.gemv(act, packed, scales, cfg, early=False)  # noqa: E731
            exact = mma.gemm_reference(act, packed, scales, residual=True)
        elif kind == "dp4a":
            run = lambda: dp4a.gemv(act, packed, scales, cfg, ws)  # noqa: E731
            exact = mma.gemm_reference(act, packed, scales, residual=True)
        else:
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
