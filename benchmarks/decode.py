"""Decode GEMV candidates side by side at the 27B's per-rank TP=2 shapes, M = 1 … 16 (`make bench-decode`).

    PYTHONPATH=plugin python -m benchmarks.decode [--out DIR] [--budget SECONDS]

Issue 5 left the decode GEMV short of its targets (docs/benchmarks.md): at M = 1 the N = 5120 layers launch
too few programs to hide latency, and at M = 2 … 16 the tensor-core `dot` path is slower than bf16 cuBLAS.
This bench measures, in one run and against the same bf16 baseline and floor:
- the paths the dispatcher took before (`fma` at M = 1, `dot` beyond: BEFORE below);
- split-K `fma` at M = 1 (K cut into slices, one program per slice and tile of N), with its two
  reductions: "fixup" (one launch; the last program of a tile sums the partials) and "pass" (partials, then
  a small reduce launch); a third, "atomic" (fp32 atomic_add into a zeroed buffer, then a cast launch), was
  measured slowest everywhere and dropped (docs/benchmarks.md has the figures);
- `rows`, the multi-row FMA kernel (one decode of a weight tile serves BM rows), with and without split-K
  (not dispatched: benchmarks/gemv_variants.py holds it);
- at M >= 4, the int8 path (W8 kept at load, per-token int8 activations) through the Triton int8 GEMM with
  BM = 16, the per-token quantization's time included (torch._int_mm refuses M <= 16).
Every candidate is checked against the float32 reference on fresh random inputs with the output poisoned,
before timing and (split-K: counters must be left at zero) again after its timed graph replays; a candidate
that fails is reported and not timed. Times are medians of CUDA-graph replays over enough weight copies that
nothing is served from L2 (bench_kernels.time_graph). Writes decode.md / decode.json to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import kernels as bk
from bonsai_vllm.ternary.kernels.gemv import GemvConfig
from bonsai_vllm.ternary.kernels.int8mm import Int8GemmConfig
from bonsai_vllm.ternary.reference import dequantize, int8_decompose

SHAPES = bk.SHAPES
MS = [1, 2, 4, 8, 16]


def _fma(bn: int, bw: int, warps: int, **split) -> GemvConfig:
    return GemvConfig(variant="fma", bm=1, bn=bn, bw=bw, warps=warps, stages=1, **split)


def _dot(bm: int, bn: int, bw: int, warps: int, stages: int) -> GemvConfig:
    return GemvConfig(variant="dot", bm=bm, bn=bn, bw=bw, warps=warps, stages=stages)


def _rows(bm: int, bn: int, bw: int, warps: int) -> GemvConfig:
    return GemvConfig(variant="rows", bm=bm, bn=bn, bw=bw, warps=warps, stages=1)


FMA_TILES = [_fma(bn=32, bw=32, warps=2), _fma(bn=64, bw=32, warps=4), _fma(bn=16, bw=32, warps=2),
             _fma(bn=32, bw=32, warps=4)]  # the M = 1 kernel's tiles, split by SPLITS too
SPLITS = [2, 4, 8]
ROWS_TILES = {  # BM -> tiles; no spills, <= 168 registers but one (ptxas, sm_90)
    2: [_rows(bm=2, bn=32, bw=32, warps=4), _rows(bm=2, bn=16, bw=32, warps=2), _rows(bm=2, bn=32, bw=16, warps=2),
        _rows(bm=2, bn=64, bw=32, warps=8)],
    4: [_rows(bm=4, bn=32, bw=32, warps=4), _rows(bm=4, bn=16, bw=32, warps=4), _rows(bm=4, bn=32, bw=16, warps=4),
        _rows(bm=4, bn=16, bw=32, warps=2)],
    8: [_rows(bm=8, bn=16, bw=32, warps=4), _rows(bm=8, bn=32, bw=32, warps=8), _rows(bm=8, bn=16, bw=16, warps=2),
        _rows(bm=8, bn=16, bw=32, warps=8)],
    16: [_rows(bm=16, bn=16, bw=32, warps=4), _rows(bm=16, bn=16, bw=16, warps=2), _rows(bm=16, bn=16, bw=16, warps=4),
         _rows(bm=16, bn=16, bw=32, warps=8)]}
ROWS_SPLITS = [1, 2, 4]
INT8_CONFIGS = [Int8GemmConfig(bm=16, bn=64, bk=128, group_m=1, warps=4, stages=4),
                Int8GemmConfig(bm=16, bn=128, bk=128, group_m=1, warps=4, stages=4),
                Int8GemmConfig(bm=16, bn=64, bk=256, group_m=1, warps=4, stages=3),
                Int8GemmConfig(bm=16, bn=32, bk=256, group_m=1, warps=2, stages=4),
                Int8GemmConfig(bm=64, bn=128, bk=128, group_m=8, warps=4, stages=4)]  # the last: the old default
FMA_TOL, DOT_TOL, INT8_TOL = 3e-3, 5e-3, 2e-2  # vs the float32 judge (bf16 output; dot: 3 roundings; int8: ~1%)


def before_config(m: int, n: int) -> GemvConfig:
    """gemv.default_config as it was before this bench (docs/benchmarks.md, first H200 sweep)."""
    if m == 1:
        return _fma(bn=32, bw=32, warps=2) if n > 8192 else _fma(bn=64, bw=32, warps=4)
    if m <= 8:
        return _dot(bm=16, bn=16, bw=16, warps=1, stages=3)
    return _dot(bm=16, bn=32, bw=16, warps=2, stages=3) if n > 5120 else _dot(bm=16, bn=16, bw=16, warps=1, stages=3)


def candidates(m: int, n: int) -> list[tuple]:
    """("gemv", GemvConfig) and ("int8", Int8GemmConfig) candidates at batch m; the BEFORE config first."""
    c = [("gemv", before_config(m, n))]
    if m == 1:
        c += [("gemv", t) for t in FMA_TILES]
        c += [("gemv", replace(t, split=s, reduce="fixup")) for t in FMA_TILES for s in SPLITS]
        c += [("gemv", _fma(bn=32, bw=32, warps=2, split=s, reduce="pass")) for s in SPLITS]
    else:
        if m <= 4:
            c += [("gemv", _fma(bn=32, bw=32, warps=2)), ("gemv", _fma(bn=32, bw=32, warps=2, split=4, reduce="fixup"))]
        for bm in ([m] if m <= 8 else [8, 16]):
            for t in ROWS_TILES[bm]:
                c += [("gemv", replace(t, split=s, reduce="fixup") if s > 1 else t) for s in ROWS_SPLITS]
            c += [("gemv", replace(ROWS_TILES[bm][0], split=4, reduce="pass"))]
    if m >= 4:
        c += [("int8", cfg) for cfg in INT8_CONFIGS]
    return list(dict.fromkeys(c))


def label(kind: str, cfg: GemvConfig | Int8GemmConfig) -> str:
    return f"{kind} {cfg}" if kind == "int8" else str(cfg)


def family(kind: str, cfg: GemvConfig | Int8GemmConfig) -> str:
    if kind == "int8":
        return "int8"
    if cfg.variant == "fma":
        return "fma split" if cfg.split > 1 else "fma"
    return cfg.variant


# ------------------------------------------------------------------------------------ checks and runs

class Layer:
    """One layer's tensors at a real shape, with enough copies of each weight form to defeat the L2."""

    def __init__(self, n: int, k: int, dev, seed: int, l2: int):
        from bonsai_vllm.ternary.kernels import int8mm

        self.n, self.k = n, k
        self.packed, self.scales, _ = bk.random_layer(n, k, dev, seed)
        self.w_ref = dequantize(self.packed, self.scales, 128)  # float32 [N, K]
        self.q, self.rs = int8mm.int8_scales(self.scales)
        self.tern_bytes = self.packed.numel() * 4 + self.scales.numel() * 2
        self.ct = bk.n_copies(self.tern_bytes, l2)
        self.tern = [(self.packed, self.scales)] + [(self.packed.clone(), self.scales.clone())
                                                    for _ in range(self.ct - 1)]
        d0 = self.w_ref.to(torch.bfloat16)
        self.cd = bk.n_copies(d0.numel() * 2, l2)
        self.dense = [d0] + [d0.clone() for _ in range(self.cd - 1)]
        self.w8_ref, rs_ref = int8_decompose(self.packed, self.scales, 128)
        w8 = int8mm.expand_int8(self.packed, self.q)
        assert torch.equal(w8, self.w8_ref) and torch.equal(self.rs, rs_ref), "expand_int8 / int8_scales"
        self.c8 = bk.n_copies(w8.numel(), l2)
        self.w8s = [w8] + [w8.clone() for _ in range(self.c8 - 1)]


def run_gemv(layer: Layer, xp: torch.Tensor, cfg: GemvConfig, i: int = 0, out=None) -> torch.Tensor:
    from benchmarks.gemv_variants import ternary_gemv_variant  # the served gemv.ternary_gemv, or `rows`

    return ternary_gemv_variant(xp, layer.tern[i][0], layer.tern[i][1], prepared=True, config=cfg, out=out)


def run_int8(layer: Layer, xr: torch.Tensor, cfg: Int8GemmConfig, i: int = 0, out=None,
             qbm: int = 1) -> torch.Tensor:
    from bonsai_vllm.ternary.kernels import hadamard, int8mm

    xq, ts = hadamard.quantize_per_token(xr, bm=qbm)
    return int8mm.int8_gemm(xq, layer.w8s[i], ts, layer.rs, config=cfg, out=out)


def check(layer: Layer, m: int, kind: str, cfg: GemvConfig | Int8GemmConfig, dev, seed: int) -> float:
    """Relative error against the float32 judge on fresh inputs, output poisoned (inf: poison left)."""
    from bonsai_vllm.ternary.kernels import gemv, hadamard

    xr = bk.randn(m, layer.k, device=dev, seed=seed)
    out = bk.nan(m, layer.n, device=dev)
    if kind == "gemv":
        y = run_gemv(layer, hadamard.gemv_order(xr, dtype=gemv.x_dtype(cfg)), cfg, out=out)
    else:
        y = run_int8(layer, xr, cfg, out=out)
    return bk.rel(y, xr.float() @ layer.w_ref.t())


def tol(kind: str, cfg: GemvConfig | Int8GemmConfig) -> float:
    t = INT8_TOL if kind == "int8" else (DOT_TOL if cfg.variant == "dot" else FMA_TOL)
    return 2 * t if bk.SMOKE and t < INT8_TOL else t  # the interpreter's float32 -> bf16 truncates


def bench_one(layer: Layer, m: int, kind: str, cfg: GemvConfig | Int8GemmConfig, dev, seed: int, xr: torch.Tensor,
              xps: dict,
              quant_us: float | None) -> dict:
    from bonsai_vllm.ternary.kernels import gemv

    rec = dict(kind=kind, cfg=asdict(cfg), label=label(kind, cfg), family=family(kind, cfg))
    err = check(layer, m, kind, cfg, dev, seed)
    rec["err"] = err
    if not err < tol(kind, cfg):
        rec["status"] = "FAIL"
        bk.FAILURES.append(f"{layer.n}x{layer.k} M={m} {rec['label']}: error {err:.3g}")
        return rec
    if kind == "gemv":
        xp = xps[gemv.x_dtype(cfg)]
        rec["us"] = bk.time_graph(lambda i: run_gemv(layer, xp, cfg, i), layer.ct, CALLS)
    else:
        from bonsai_vllm.ternary.kernels import hadamard, int8mm

        xq, ts = hadamard.quantize_per_token(xr)
        rec["gemm_us"] = bk.time_graph(lambda i: int8mm.int8_gemm(xq, layer.w8s[i], ts, layer.rs, config=cfg),
                                       layer.c8, CALLS)
        rec["us"] = rec["gemm_us"] + quant_us
    err2 = check(layer, m, kind, cfg, dev, seed + 1)  # after hundreds of replays: counters still at zero?
    rec["err_after"] = err2
    if not err2 < tol(kind, cfg):
        rec["status"] = "FAIL after timing"
        bk.FAILURES.append(f"{layer.n}x{layer.k} M={m} {rec['label']}: error {err2:.3g} after timing")
        rec.pop("us")
        return rec
    rec["status"] = "ok"
    return rec


CALLS = 100


def bench_shape(name: str, k: int, n: int, bw: float, l2: int, dev, seed: int, deadline: float) -> list[dict]:
    from bonsai_vllm.ternary.kernels import hadamard

    layer = Layer(n, k, dev, seed, l2)
    rows = []
    for m in MS:
        xr = bk.randn(m, k, device=dev, seed=seed + m)
        xps = {dt: hadamard.gemv_order(xr, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
        t_bf16 = bk.time_graph(lambda i: F.linear(xr, layer.dense[i]), layer.cd, CALLS)
        floor = (layer.tern_bytes + 2 * m * k + 2 * m * n) / bw * 1e6
        row = dict(layer=name, K=k, N=n, M=m, bf16_us=t_bf16, floor_us=floor, cands=[])
        quant_us = None
        if m >= 4:
            qt = {b: bk.time_graph(lambda i: hadamard.quantize_per_token(xr, bm=b), 1, CALLS) for b in (1, 2)}
            quant_us = min(qt.values())
            row["quant_us"] = quant_us
        cands = candidates(m, n)
        for j, (kind, cfg) in enumerate(cands):
            if j and time.time() > deadline:  # out of time: keep the BEFORE config only
                row["cut"] = len(cands) - j
                break
            rec = bk.guard(f"{name} M={m} {label(kind, cfg)}", bench_one, layer, m, kind, cfg, dev,
                           seed + 100 * m + j, xr, xps, quant_us)
            if rec is not None:
                row["cands"].append(rec)
        # the BEFORE config timed a second time, last: the spread says what difference is noise
        rec = bk.guard(f"{name} M={m} repeat", bench_one, layer, m, "gemv", before_config(m, n), dev, seed + 99, xr,
                       xps, quant_us)
        if rec is not None and "us" in rec:
            row["before_repeat_us"] = rec["us"]
        timed = [c for c in row["cands"] if "us" in c]
        if timed:
            before = timed[0] if timed[0]["label"] == str(before_config(m, n)) else None
            best = min(timed, key=lambda c: c["us"])
            row["before_us"] = before["us"] if before else float("nan")
            row["best_us"], row["best"] = best["us"], best["label"]
            row["best_by_family"] = {}
            for c in timed:
                f = c["family"]
                if f not in row["best_by_family"] or c["us"] < row["best_by_family"][f][0]:
                    row["best_by_family"][f] = (c["us"], c["label"])
        rows.append(row)
        bk.say(f"  {name:8s} M={m:3d} bf16 {t_bf16:7.2f}  before {row.get('before_us', float('nan')):7.2f} "
               f"(again {row.get('before_repeat_us', float('nan')):7.2f})  best {row.get('best_us', float('nan')):7.2f} "
               f"{row.get('best', '-')}  floor {floor:5.2f}" + (f"  [{row['cut']} cut for time]" if "cut" in row else ""))
    layer = None  # its weight copies go before the next shape's are allocated
    if not bk.SMOKE:
        torch.cuda.empty_cache()
    return rows


def fmt(rows: list[dict]) -> str:
    fams = ["fma", "fma split", "rows", "dot", "int8"]
    out = ["| layer K→N | M | bf16 µs | before µs (again) | best µs | best config | × bf16 before → best | "
           "best / floor | " + " | ".join(f"best {f} µs" for f in fams) + " |",
           "| --- " * (8 + len(fams)) + "|"]
    for r in rows:
        if "best_us" not in r:
            out.append(f"| {r['layer']} {r['K']}→{r['N']} | {r['M']} | {r['bf16_us']:.2f} | no candidate ran |")
            continue
        fb = r["best_by_family"]
        out.append(
            f"| {r['layer']} {r['K']}→{r['N']} | {r['M']} | {r['bf16_us']:.2f} | {r['before_us']:.2f} "
            f"({r.get('before_repeat_us', float('nan')):.2f}) | {r['best_us']:.2f} | {r['best']} | "
            f"{r['bf16_us'] / r['before_us']:.2f} → **{r['bf16_us'] / r['best_us']:.2f}** | "
            f"{r['best_us'] / r['floor_us']:.1f} | "
            + " | ".join(f"{fb[f][0]:.2f}" if f in fb else "" for f in fams) + " |")
    return "\n".join(out)


# ------------------------------------------------------------------------- parallel compilation (warm)

def warm_tasks(dev: str = "cuda") -> list:
    """One call per kernel configuration the run compiles, with the real calls' dtypes and divisibility."""
    from bonsai_vllm.ternary.kernels import gemv, hadamard

    n, k = 256, 1024
    layer = Layer(n, k, dev, 1, 0)
    seen, tasks = set(), []
    for m in MS:
        for kind, cfg in candidates(m, 5120) + candidates(m, 17408):
            # one compile per specialization: the split count is a runtime argument, its reduction is not
            key = (kind, replace(cfg, split=min(cfg.split, 2)) if kind == "gemv" else cfg)
            if key in seen:
                continue
            seen.add(key)
            if kind == "gemv":
                tasks.append(lambda m=m, cfg=cfg: run_gemv(layer, hadamard.gemv_order(
                    bk.randn(m, k, device=dev, seed=m), dtype=gemv.x_dtype(cfg)), cfg))
            else:
                tasks.append(lambda m=m, cfg=cfg: run_int8(layer, bk.randn(m, k, device=dev, seed=m), cfg))
    for b in (1, 2):
        for kk in (3072, 5120, 8704):
            tasks.append(lambda b=b, kk=kk: hadamard.quantize_per_token(bk.randn(4, kk, device=dev, seed=b), bm=b))
    return tasks


def warm_worker(index: int, jobs: int) -> int:
    return bk.run_warm_tasks(warm_tasks(), index, jobs)


def warm(jobs: int) -> None:
    import subprocess

    t0 = time.time()
    cmd = [sys.executable, "-m", "benchmarks.decode", "--jobs", str(jobs)]
    procs = [subprocess.Popen(cmd + ["--warm-worker", str(i)]) for i in range(jobs)]
    codes = [p.wait(timeout=400) for p in procs]
    bk.say(f"## compiled {len(warm_tasks())} configurations in {jobs} processes in {time.time() - t0:.0f} s "
           f"(worker exit codes {codes})")


def main(argv=None) -> int:
    global SHAPES, MS, CALLS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=330.0, help="seconds after which only BEFORE configs run")
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--warm-worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    t_start = time.time()
    if args.smoke:  # CPU dry run through the interpreter at toy shapes (times are dummies)
        bk._smoke_setup()
        SHAPES, MS, CALLS = [("toy", 1024, 64)], [1, 2, 4, 16], 1
    elif not torch.cuda.is_available():
        print("bench_decode: no CUDA device; on CPU the check is tests/core/test_kernels.py (Triton interpreter)")
        return 2
    if args.warm_worker is not None:
        return warm_worker(args.warm_worker, args.jobs)
    import triton

    dev = torch.device("cpu" if bk.SMOKE else "cuda")
    if bk.SMOKE:
        name, l2 = "CPU (Triton interpreter, smoke run)", 1 << 20
    else:
        props = torch.cuda.get_device_properties(dev)
        l2 = getattr(props, "L2_cache_size", 64 << 20)
        name = f"{props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB"
    bk.say(f"# {name}; torch {torch.__version__}, triton {triton.__version__}; {datetime.datetime.now():%Y-%m-%d %H:%M}")
    torch.backends.cuda.matmul.allow_tf32 = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.jobs > 0 and not bk.SMOKE:
        warm(args.jobs)
    bw = bk.copy_bandwidth()
    bk.say(f"## copy bandwidth {bw / 1e12:.3f} TB/s")
    deadline = t_start + args.budget
    rows = []
    for i, (lname, k, n) in enumerate(SHAPES):
        res = bk.guard(f"shape {lname}", bench_shape, lname, k, n, bw, l2, dev, 1000 * (i + 1), deadline)
        rows += res or []
        (out / "decode.json").write_text(json.dumps(dict(device=name, copy_bw=bw, rows=rows, failures=bk.FAILURES,
                                                         seconds=time.time() - t_start), indent=1, default=str))
    table = fmt(rows)
    text = (f"# {name}\n\ncopy bandwidth {bw / 1e12:.2f} TB/s; {time.time() - t_start:.0f} s\n\n{table}\n\n"
            "## check failures\n" + ("\n".join(bk.FAILURES) or "none"))
    (out / "decode.md").write_text(text + "\n")
    (out / "decode_log.txt").write_text("\n".join(bk.LOG) + "\n")
    print("\n" + text, flush=True)
    return 1 if bk.FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
