"""The served ternary layers without W8 against bf16 cuBLAS, the byte floor and gemlite (issue 19; `make bench-layers`).

    PYTHONPATH=plugin python -m benchmarks.layers [--out DIR] [--ms 1,4,16,24,48,64,128] [--budget SECONDS]
                                                  [--rotated]

On a CUDA GPU, for the six per-rank TP=2 layers of the 27B and batch rows M, in one run:
- ours: `ternary_linear` as served on the 12 GB cards (W8 not kept at load), on unrotated input with the layer's
  Hadamard signs wherever K is whole 1024-blocks, as served: the rotation + prep kernel runs ahead of the GEMV or
  mma kernel; down_proj's 8704 takes rotated input, as vLLM hands it over (`--rotated`: every layer on rotated
  input, `dp4a.prepare` ahead, what the tables before 2026-12-04 timed), so the route is
  the dispatch's own (the streaming GEMV at 1-4 rows, the int8 tensor-core kernel to 64, the GEMM decoding the
  codes to 512, W8 expanded per call beyond); the same call with the CUDA C kernels launched the ordinary
  way instead of as programmatic dependents of the prep where the rule launches them so (nvrtc.launch's
  `early`, mma.early_pays); and, where the CUDA C rotation + prep (rotate_prep.cu) served, the same call with
  Triton's (hadamard.rotate_dp4a, BONSAI_CUDA_ROTATION=0);
- bf16 cuBLAS (`F.linear`) on the dequantized weights;
- the byte floor: the codes and scales read once at the measured copy bandwidth;
- gemlite 0.6 (PyPI; Triton low-bit kernels, 2-bit codes with group-128 scales, HQQ's (W_q - zero) · scale,
  bf16 activations) on the same codes, as a public anchor. It is optional: `pip install gemlite==0.6.0.post2`;
  without it the column says so. Its first call per row count autotunes (no H200 entry in its config cache).
Every route is checked on fresh random input against the float32 layer before it is timed (ours to the bound of
its route; gemlite's error is reported, not bounded: it is not ours to fix). Times are medians of CUDA-graph
replays over enough weight copies that nothing is served from L2 (benchmarks.kernels.time_graph). The last
lines are the table that docs/benchmarks.md keeps, then the check failures."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import kernels as bk
from benchmarks.anchors import gemlite_layer, gemlite_version
from bonsai_vllm.ternary.reference import signed_block_hadamard

MS = [1, 4, 16, 24, 48, 64, 128]
SHAPES = bk.SHAPES
# Relative error against float32 that each of our routes must meet (int8 activations per group of 128: ~6.5e-3;
# dp4a at one row carries the residual term, the 3e-3 target; the expanded int8 GEMM quantizes per token).
BOUND = {"dp4a": 3e-3, "stream": 3e-3, "mma": 1e-2, "gemv": 1e-2, "int8": 2e-2}


def set_early_launch(on: bool) -> None:
    """Whether the CUDA C kernels (stream_gemv, mma) are launched to start while the prep ahead of them runs."""
    from bonsai_vllm.ternary.kernels import mma, stream_gemv

    mma.EARLY_LAUNCH = stream_gemv.EARLY_LAUNCH = on


def set_cuda_rotation(tws: list, on: bool) -> None:
    """Whether the layer copies rotate and prepare unrotated rows by the CUDA C kernel (rotate_prep.cu) or by
    Triton's (hadamard.rotate_dp4a)."""
    for tw in tws:
        tw.cuda_rotation = on


BLOCK = 1024  # the Hadamard block the 27B's layers rotate by


def served_with_signs(layer: bk.ServedCopies) -> tuple[list, torch.Tensor | None]:
    """The layer's weight copies prepared with its Hadamard signs (so `ternary_linear` rotates x itself, as
    served), and the signs; (the rotated-input copies, None) where K is not whole blocks (down_proj's 8704,
    which vLLM hands over rotated by its TP slice)."""
    from bonsai_vllm.ternary.kernels import linear

    if layer.signs.numel() % BLOCK:
        return layer.served, None
    return [linear.prepare(p, s, layer.signs, expand_int8=False) for p, s in layer.tern], layer.signs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--layers", default=",".join(name for name, _, _ in SHAPES))
    ap.add_argument("--budget", type=float, default=1e9, help="seconds of checks and timings, then the table")
    ap.add_argument("--rotated", action="store_true",
                    help="rotated x and dp4a.prepare ahead on every layer (the served path rotates x itself where K "
                         "is whole 1024-blocks)")
    ap.add_argument("--unrotated", action="store_true", help="the default (kept for the commands docs/benchmarks.md "
                                                             "recorded)")
    args = ap.parse_args(argv)
    ms, layers = [int(v) for v in args.ms.split(",")], args.layers.split(",")
    from bonsai_vllm.ternary.kernels import linear

    dev, out = "cuda", Path(args.out)
    deadline = time.time() + args.budget
    bw = bk.copy_bandwidth()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    version = gemlite_version()
    anchor = f"gemlite {version}" if version else "gemlite (not installed)"
    bk.say(f"copy bandwidth {bw / 1e12:.2f} TB/s; anchor: {anchor}")
    rows, failures = [], []
    for name, k, n in SHAPES:
        if name not in layers:
            continue
        layer = bk.served_copies(n, k, dev, seed=7, l2=l2)
        w_ref, dense, copies = layer.w_ref, layer.dense, layer.copies
        tws, signs = (layer.served, None) if args.rotated else served_with_signs(layer)
        rotated = signs is None
        gl = [gemlite_layer(p, s) for p, s in layer.tern] if version else None
        floor = layer.nbytes / bw * 1e6
        for m in ms:
            if time.time() > deadline:
                failures.append(f"{name} M={m}: not run (--budget spent)")
                continue
            x = bk.randn(m, k, device=dev, seed=300 + m)  # taken as rotated unless `signs`
            plain = x.float() @ w_ref.t()  # gemlite's layer: it does not rotate
            want = plain if rotated else signed_block_hadamard(x.float(), signs, BLOCK) @ w_ref.t()
            route = linear.route(m, tws[0])
            y = linear.ternary_linear(x, tws[0], rotated=rotated)
            err = bk.rel(y, want)
            if err > BOUND[route.path]:
                failures.append(f"{name} M={m} {route}: {err:.2e} from float32 (bound {BOUND[route.path]:.0e})")
                continue
            t_ours = bk.time_graph(lambda i: linear.ternary_linear(x, tws[i], rotated=rotated), copies,
                                   bk.calls_for(30))
            set_early_launch(False)
            t_late = bk.time_graph(lambda i: linear.ternary_linear(x, tws[i], rotated=rotated), copies,
                                   bk.calls_for(30))
            set_early_launch(True)
            t_triton = float("nan")  # the same call with the Triton rotation + prep where the CUDA C one served
            if route.path in ("stream", "mma", "dp4a") and tws[0].cuda_rotation and not rotated:
                set_cuda_rotation(tws, False)
                t_triton = bk.time_graph(lambda i: linear.ternary_linear(x, tws[i]), copies, bk.calls_for(30))
                set_cuda_rotation(tws, True)
            t_bf16 = bk.time_graph(lambda i: F.linear(x, dense[i]), len(dense), bk.calls_for(30))
            t_gl = err_gl = float("nan")
            if gl is not None:
                try:
                    err_gl = bk.rel(gl[0](x), plain)
                    t_gl = bk.time_graph(lambda i: gl[i](x), copies, bk.calls_for(30))
                except Exception as e:  # noqa: BLE001 - the anchor failing is reported; our figures stand
                    failures.append(f"{name} M={m} gemlite: {type(e).__name__}: {str(e)[:200]}")
            label = f"int8 GEMM, W8 {route.w8}" if route.path == "int8" else str(route)
            row = dict(layer=name, K=k, N=n, M=m, x="rotated" if rotated else "unrotated", route=label, ours_us=t_ours,
                       late_us=t_late, triton_rotation_us=t_triton, err=err, bf16_us=t_bf16, floor_us=floor,
                       gemlite_us=t_gl, gemlite_err=err_gl)
            rows.append(row)
            bk.say(f"  {name:8s} M={m:4d} ours {t_ours:8.2f} µs ({route.path}, err {err:.1e}; ordinary launch "
                   f"{t_late:8.2f}; Triton rotation {t_triton:8.2f})  bf16 {t_bf16:8.2f}  "
                   f"floor {floor:6.2f}  gemlite {t_gl:8.2f} (err {err_gl:.1e})")
    x_kind = "rotated" if args.rotated else "unrotated where K is whole 1024-blocks (the rotation + prep kernel ahead)"
    lines = [f"anchor: {anchor}; copy bandwidth {bw / 1e12:.2f} TB/s; x {x_kind}", "",
             "| layer | M | route | ours µs | error | ordinary launch µs | Triton rotation µs | bf16 µs | × bf16 | "
             "floor µs | % of copy bw | gemlite µs | gemlite error | × gemlite |", "|" + "---|" * 14]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['M']} | {r['route']} | {r['ours_us']:.2f} | "
                     f"{r['err']:.1e} | {r['late_us']:.2f} | {r['triton_rotation_us']:.2f} | {r['bf16_us']:.2f} | "
                     f"{r['bf16_us'] / r['ours_us']:.2f} | "
                     f"{r['floor_us']:.2f} | {100 * r['floor_us'] / r['ours_us']:.0f} | {r['gemlite_us']:.2f} | "
                     f"{r['gemlite_err']:.1e} | {r['gemlite_us'] / r['ours_us']:.2f} |")
    return bk.report(out, "layers", {"rows": rows, "anchor": anchor, "copy_bandwidth": bw}, lines, failures)


if __name__ == "__main__":
    raise SystemExit(main())
