"""Issue 19's int8 GEMM that decodes the 2-bit codes itself (no W8), at decode sizes M = 2 … 64.

    PYTHONPATH=plugin python -m benchmarks.codes_gemm [--out DIR] [--budget SECONDS]

The kernel is the plugin's `int8mm.codes_gemm` (since issue 19's prefill route: M > 64 rows without W8, behind
BONSAI_CODES_GEMM; `make bench-prefill` measures it there, benchmarks/prefill.py); this benchmark keeps its
M <= 64 table with small tiles (BK = 128, one scale group per K step).

On the 12 GB cards W8 (int8 weights, 4× the codes) does not fit, so at M = 2 … 64 rows every step ran
the tensor-core GEMV `dot` straight from the codes, at 0.6–0.9× bf16 cuBLAS (docs/benchmarks.md). The
W8-kept int8 GEMM is 1.7–2.3× faster at 16 rows. This kernel is that GEMM with its B operand made in
registers from the codes: per K tile it loads the words [BN, BK/16] and the int8 group scale q
(ternary.reference.int8_decompose), makes W8 = code · q and feeds the int8 product; the activations are the
per-token int8 of the rotated x (hadamard.quantize_per_token). The sums are exact int32, so it must equal
the W8 route to rounding of the final float32 rescale.

Prediction (gate_up 5120→17408, M = 16): the codes are 5.6 µs of bytes; the W8 GEMM takes 27.6 µs with
4× those bytes from L2-missing memory, so it is not bandwidth-bound either; decoding adds ~4 integer
operations per weight per program, amortized over BM rows. Expect 25–40 µs against 62 µs (`dot`) and
47 µs (bf16 cuBLAS). Measured on the H200 (2026-12-01, docs/benchmarks.md) with the first decode (one code
per thread, re-laid out through shared memory): 88 µs — the decode and the re-layout for the operand sit in
series with a small product in every K step. The plugin's kernel decodes four weights per integer operation
into each thread's own registers (int8mm._word_weights); not measured here since.

One run: checks each configuration against the W8 route (torch) at every shape first, then times ours,
the served route without W8 (`ternary_linear`, W8 not kept), the served route with W8 kept, and bf16
cuBLAS, as CUDA-graph replays over weight copies that miss L2. Prints one table.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import kernels as bk
from bonsai_vllm.ternary.kernels.int8mm import Int8GemmConfig
from bonsai_vllm.ternary.reference import dequantize, int8_decompose

# bk = 128: one scale group per K step, as the first version of the kernel had it fixed
CONFIGS = [Int8GemmConfig(bm, bn, 128, 1, w, s, backend="codes") for bm in (16, 32, 64) for bn in (32, 64, 128)
           for w in (4, 8) for s in (3, 4) if not (bn == 32 and w == 8)]


def codes_gemm(xq: torch.Tensor, packed: torch.Tensor, q: torch.Tensor, ts: torch.Tensor, rs: torch.Tensor,
               config: Int8GemmConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] bf16: the plugin's int8mm.codes_gemm at `config`, no bias."""
    from bonsai_vllm.ternary.kernels import int8mm

    return int8mm.codes_gemm(xq, packed, q, ts, rs, None, torch.bfloat16, out=out, config=config)


def reference(xq, packed, scales, ts) -> torch.Tensor:
    """The W8 route in float64: exact products, then the same rescale."""
    w8, rs = int8_decompose(packed, scales, 128)
    return (xq.double() @ w8.double().t()) * ts.double()[:, None] * rs.double()[None, :]


SHAPES = bk.SHAPES
MS = [2, 4, 8, 16, 24, 32, 48, 64]


def bench_shape(name: str, k: int, n: int, bw: float, l2: int, start: float, budget: float, rows: list,
                failures: list) -> None:
    from bonsai_vllm.ternary.kernels import hadamard, int8mm, linear

    dev = "cuda"
    packed, scales, _ = bk.random_layer(n, k, dev, seed=7)
    w_ref = dequantize(packed, scales, 128)  # float32 [N, K]
    q, rs = int8mm.int8_scales(scales)
    copies = bk.n_copies(n * k // 4 + n * k // 128 * 2, l2)
    tern = [(packed.clone(), q.clone()) for _ in range(copies)]
    tw_no_w8 = [linear.prepare(p, scales, None, expand_int8=False) for p, _ in tern]
    w8_copies = bk.n_copies(n * k, l2)
    tw_w8 = [linear.prepare(packed.clone(), scales, None, expand_int8=True) for _ in range(w8_copies)]
    dense = [w_ref.to(torch.bfloat16) for _ in range(bk.n_copies(2 * n * k, l2))]
    w8 = int8mm.expand_int8(packed, q)
    for m in MS:
        xr = bk.randn(m, k, device=dev, seed=100 + m)
        xq, ts = hadamard.quantize_per_token(xr)
        want = reference(xq, packed, scales, ts).float()
        served_int8 = int8mm.int8_gemm(xq, w8, ts, rs, None, torch.bfloat16)  # the W8 route's own kernel
        judge = xr.float() @ w_ref.t()
        ok_cfgs = []
        for cfg in CONFIGS:
            try:
                y = codes_gemm(xq, packed, q, ts, rs, cfg, out=bk.nan(m, n, device=dev))
            except Exception as e:  # resources (shared memory) at a config: skip it, say so
                bk.say(f"  {name} M={m} {cfg}: {type(e).__name__}: {str(e)[:160]}")
                continue
            # The same int32 sums and rescale as int8_gemm: its output to the bit where both round alike,
            # and the exact float64 route within bf16 output rounding (int8_gemm's own distance, ~3e-3).
            err = bk.rel(y, want)
            if not (torch.isfinite(y).all() and err < 4e-3 and bk.rel(y, served_int8) < 1e-3):
                failures.append(f"{name} M={m} {cfg}: {err:.2e} vs the exact W8 route, "
                                f"{bk.rel(y, served_int8):.2e} vs int8_gemm")
                continue
            ok_cfgs.append(cfg)
        if not ok_cfgs:
            continue
        judge_err = bk.rel(codes_gemm(xq, packed, q, ts, rs, ok_cfgs[0]), judge)
        over = time.monotonic() - start > budget
        timed = {}
        for cfg in (ok_cfgs[:1] if over else ok_cfgs):
            timed[cfg] = bk.time_graph(lambda i: codes_gemm(xq, tern[i][0], tern[i][1], ts, rs, cfg),
                                       copies, bk.calls_for(30))
        best = min(timed, key=timed.get)
        t_quant = bk.time_graph(lambda i: hadamard.quantize_per_token(xr), 1, bk.calls_for(5))
        t_no_w8 = bk.time_graph(lambda i: linear.ternary_linear(xr, tw_no_w8[i], rotated=True), copies,
                                bk.calls_for(40))
        t_w8 = bk.time_graph(lambda i: linear.ternary_linear(xr, tw_w8[i], rotated=True), w8_copies,
                             bk.calls_for(30))
        t_bf16 = bk.time_graph(lambda i: F.linear(xr, dense[i]), len(dense), bk.calls_for(40))
        floor = (n * k / 4 + n * k / 128 * 2 + m * k * 2 + m * n * 2) / bw * 1e6
        ours = timed[best] + t_quant
        rows.append(dict(layer=name, K=k, N=n, M=m, ours_us=ours, gemm_us=timed[best], quant_us=t_quant,
                         config=asdict(best), served_no_w8_us=t_no_w8, served_w8_us=t_w8, bf16_us=t_bf16,
                         floor_us=floor, judge_err=judge_err, configs_timed=len(timed)))
        bk.say(f"  {name:8s} M={m:3d} ours {ours:7.2f} (gemm {timed[best]:6.2f} {best}) no-W8 {t_no_w8:7.2f} "
               f"W8 {t_w8:7.2f} bf16 {t_bf16:7.2f} floor {floor:5.2f} err {judge_err:.1e}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; past it only the best config is timed")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    args = ap.parse_args(argv)
    start = time.monotonic()
    props = torch.cuda.get_device_properties(0)
    bw = bk.copy_bandwidth()
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    bk.say(f"# {props.name}; copy bandwidth {bw / 1e12:.2f} TB/s")
    rows, failures = [], []
    for name, k, n in (s for s in SHAPES if s[0] in args.shapes.split(",")):
        bench_shape(name, k, n, bw, l2, start, args.budget, rows, failures)
        torch.cuda.empty_cache()  # this shape's weight copies are gone with bench_shape's frame
    lines = ["| layer | M | ours µs (quantize + gemm) | served no-W8 µs | × vs no-W8 | bf16 µs | × vs bf16 | "
             "served W8-kept µs | floor µs | config | error vs float32 |", "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['M']} | {r['ours_us']:.1f} | {r['served_no_w8_us']:.1f} | "
                     f"{r['served_no_w8_us'] / r['ours_us']:.2f} | {r['bf16_us']:.1f} | {r['bf16_us'] / r['ours_us']:.2f} | "
                     f"{r['served_w8_us']:.1f} | {r['floor_us']:.1f} | {Int8GemmConfig(**r['config'])} | "
                     f"{r['judge_err']:.1e} |")
    return bk.report(Path(args.out), "codes-gemm", {"rows": rows}, lines, failures)


if __name__ == "__main__":
    raise SystemExit(main())
