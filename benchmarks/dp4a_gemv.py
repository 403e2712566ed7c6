"""A candidate for issue 19, not dispatched: the M = 1 decode GEMV on dp4a with int8 activations + residual.

    PYTHONPATH=plugin python -m benchmarks.dp4a_gemv [--out DIR]

The served `fma` GEMV spends ~3.3 instructions per weight (docs/benchmarks.md) and reaches 26–30 % of copy
bandwidth at M = 1. Here a 4-byte dot product (PTX dp4a) does four weights per instruction:

- the codes of a word (code i at bits 2i) split into four int32 by `(word >> 2j) & 0x03030303`: byte b of
  lane j is the stored code u = value + 1 of input 16w + 4b + j, u in {0, 1, 2};
- the activation row is prepared once per call in the same order: x ≈ s1 · x8 + s2 · r8 (x8 the int8 of x,
  r8 the int8 of what x8 missed: the second dp4a on the residual is exllamav3's trick for int8 error well
  under bf16's), each a planar int32 [4, K/16] of 4 bytes;
- per word two chains of four dp4a give Σ u·x8 and Σ u·r8; per group of 128 the value sum is Σ u·x − Σ x,
  so y[n] = Σ_g scale[n, g] · (s1 (T1 − X1[g]) + s2 (T2 − X2[g])) in float32.
Per word: 3 shifts, 4 ANDs, 8 dp4a for 16 weights, under 1 instruction per weight.

One run: checks every configuration against the float32 reference (ternary.reference.dequantize) on fresh
data, then times it beside the served GEMV (`ternary_linear`, W8 not kept) and bf16 cuBLAS as CUDA-graph
replays over weight copies that miss L2, and prints the fraction of copy bandwidth each reaches. The
activation preparation (torch here, a handful of small launches) is timed apart: a served version would
fold it into the rotation kernel that already writes x' once per call. Measured: docs/benchmarks.md
(1.7–1.9× the served GEMV on the H200, 3e-5 error).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import kernels as bk
from bonsai_vllm.ternary.reference import dequantize
from bonsai_vllm.triton_runtime import require, tl, triton

if triton is not None:

    @triton.jit
    def _dp4a(a, b, c):
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _dp4a_gemv_kernel(w_ptr, s_ptr, xa_ptr, xr_ptr, gx_ptr, gr_ptr, y_ptr, s1, s2, N, KW, CHUNK,
                          BN: tl.constexpr, BW: tl.constexpr, ATOMIC: tl.constexpr):
        # grid: (cdiv(N, BN), splits). Program (t, s) walks words [s·CHUNK, (s+1)·CHUNK) of K for BN rows, BW
        # words (BW / 8 groups) per step; with splits > 1 the partial sums meet by fp32 atomic_add in y (zeroed).
        G8: tl.constexpr = BW // 8
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        nmask = rn < N
        rw = tl.arange(0, BW)
        rg = tl.arange(0, G8)
        acc = tl.zeros([BN], dtype=tl.float32)
        zero = tl.zeros([BN, BW], dtype=tl.int32)
        G = KW // 8
        k0 = tl.program_id(1) * CHUNK
        for w0 in range(k0, min(k0 + CHUNK, KW), BW):
            p = tl.load(w_ptr + rn[:, None] * KW + w0 + rw[None, :], mask=nmask[:, None], other=0)  # [BN, BW]
            t1 = zero
            t2 = zero
            for j in tl.static_range(4):
                c = (p >> (2 * j)) & 0x03030303
                xa = tl.load(xa_ptr + j * KW + w0 + rw)[None, :]
                xr = tl.load(xr_ptr + j * KW + w0 + rw)[None, :]
                t1 = _dp4a(c, xa, t1)
                t2 = _dp4a(c, xr, t2)
            g0 = w0 // 8
            T1 = tl.sum(tl.reshape(t1, (BN, G8, 8)), axis=2)  # [BN, G8] Σ u·x8 per group
            T2 = tl.sum(tl.reshape(t2, (BN, G8, 8)), axis=2)
            X1 = tl.load(gx_ptr + g0 + rg)[None, :]
            X2 = tl.load(gr_ptr + g0 + rg)[None, :]
            sc = tl.load(s_ptr + rn[:, None] * G + g0 + rg[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
            v = s1 * (T1 - X1).to(tl.float32) + s2 * (T2 - X2).to(tl.float32)
            acc += tl.sum(sc * v, axis=1)
        if ATOMIC:
            tl.atomic_add(y_ptr + rn, acc, mask=nmask)
        else:
            tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=nmask)


@dataclass(frozen=True)
class Dp4aConfig:
    bn: int  # rows per program
    bw: int  # words per K step (a multiple of 8: whole scale groups)
    warps: int
    stages: int
    split: int = 1  # slices of K, summed by fp32 atomic_add (not deterministic in the last bits)

    def __str__(self) -> str:
        return f"bn={self.bn} bw={self.bw} warps={self.warps} stages={self.stages} split={self.split}"


CONFIGS = [Dp4aConfig(bn, bw, w, s, sp) for bn in (4, 8, 16, 32) for bw in (16, 32) for w in (1, 2, 4) for s in (2, 3)
           for sp in (1, 2, 4, 8) if 64 <= bn * bw <= 1024]


def prepare_x(x: torch.Tensor) -> tuple:
    """x [K] (float) -> (xa, xr int32 [4, K/16] planar bytes, X1, X2 int32 [K/128] group sums, s1, s2)."""
    x = x.float()
    k = x.numel()
    s1 = x.abs().max().clamp_min(1e-30) / 127
    x8 = torch.round(x / s1).clamp(-127, 127)
    r = x - x8 * s1
    s2 = r.abs().max().clamp_min(1e-30) / 127
    r8 = torch.round(r / s2).clamp(-127, 127)

    def planar(q: torch.Tensor) -> torch.Tensor:
        # lane j, word w, byte b = q[16w + 4b + j]
        b = q.to(torch.int8).view(k // 16, 4, 4).transpose(1, 2).contiguous()  # [w, j, b]
        return b.view(torch.int32).view(k // 16, 4).t().contiguous()  # [4, w]

    return (planar(x8), planar(r8), x8.view(-1, 128).sum(1).to(torch.int32), r8.view(-1, 128).sum(1).to(torch.int32),
            float(s1), float(s2))


def dp4a_gemv(prepared: tuple, packed: torch.Tensor, scales: torch.Tensor, config: Dp4aConfig,
              out: torch.Tensor | None = None) -> torch.Tensor:
    require()
    xa, xr, gx, gr, s1, s2 = prepared
    n, kw = packed.shape
    if kw % config.bw:
        raise ValueError(f"dp4a_gemv: K/16 = {kw} is not a multiple of BW = {config.bw}")
    steps = triton.cdiv(kw, config.bw)
    chunk = triton.cdiv(steps, config.split) * config.bw
    splits = triton.cdiv(kw, chunk)
    y = torch.empty(n, dtype=torch.float32, device=packed.device) if out is None else out
    if splits > 1:
        y.zero_()  # timed with the kernel: a served split-K pays it too (or a fixup pass instead)
    _dp4a_gemv_kernel[(triton.cdiv(n, config.bn), splits)](packed, scales, xa, xr, gx, gr, y, s1, s2, n, kw, chunk,
                                                           BN=config.bn, BW=config.bw, ATOMIC=splits > 1,
                                                           num_warps=config.warps, num_stages=config.stages)
    return y


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    from bonsai_vllm.ternary.kernels import linear

    dev = "cuda"
    bw = bk.copy_bandwidth()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    rows, failures = [], []
    for name, k, n in bk.SHAPES:
        packed, scales, _ = bk.random_layer(n, k, dev, seed=3)
        w_ref = dequantize(packed, scales, 128)
        tern_bytes = n * k / 4 + n * k / 128 * 2
        copies = bk.n_copies(int(tern_bytes), l2)
        tern = [(packed.clone(), scales.clone()) for _ in range(copies)]
        tws = [linear.prepare(p, s, None, expand_int8=False) for p, s in tern]
        dense = [w_ref.to(torch.bfloat16) for _ in range(bk.n_copies(2 * n * k, l2))]
        x = bk.randn(1, k, device=dev, seed=11)
        prep = prepare_x(x[0])
        want = (x.float() @ w_ref.t())[0]
        ok = []
        for cfg in CONFIGS:
            if (k // 16) % cfg.bw:
                continue
            try:
                y = dp4a_gemv(prep, packed, scales, cfg, out=torch.full((n,), float("nan"), device=dev))
            except Exception as e:
                bk.say(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            err = bk.rel(y, want)
            if not (torch.isfinite(y).all() and err < 3e-3):
                failures.append(f"{name} {cfg}: {err:.2e}")
                continue
            ok.append((cfg, err))
        if not ok:
            continue
        timed = {cfg: bk.time_graph(lambda i: dp4a_gemv(prep, tern[i][0], tern[i][1], cfg), copies, bk.calls_for(10))
                 for cfg, _ in ok}
        best = min(timed, key=timed.get)
        err = dict(ok)[best]
        t_prep = bk.time_eager(lambda: prepare_x(x[0]), reps=20)  # eager: it reads s1, s2 on the host
        t_served = bk.time_graph(lambda i: linear.ternary_linear(x, tws[i], rotated=True), copies, bk.calls_for(15))
        t_bf16 = bk.time_graph(lambda i: F.linear(x, dense[i]), len(dense), bk.calls_for(30))
        floor = tern_bytes / bw * 1e6
        rows.append(dict(layer=name, K=k, N=n, dp4a_us=timed[best], config=asdict(best), err=err,
                         served_us=t_served, bf16_us=t_bf16, floor_us=floor, prep_us=t_prep))
        bk.say(f"  {name:8s} dp4a {timed[best]:6.2f} µs ({100 * floor / timed[best]:.0f}% of copy bw, {best}, "
               f"err {err:.1e})  served {t_served:6.2f} ({100 * floor / t_served:.0f}%)  bf16 {t_bf16:6.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dp4a-gemv.json").write_text(json.dumps({"rows": rows, "failures": failures}, indent=1))
    lines = ["| layer | dp4a µs | % of copy bw | served fma µs | % of copy bw | × served | bf16 µs | × bf16 | "
             "error vs float32 | config |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['dp4a_us']:.2f} | {100 * r['floor_us'] / r['dp4a_us']:.0f} | "
                     f"{r['served_us']:.2f} | {100 * r['floor_us'] / r['served_us']:.0f} | "
                     f"{r['served_us'] / r['dp4a_us']:.2f} | {r['bf16_us']:.2f} | {r['bf16_us'] / r['dp4a_us']:.2f} | "
                     f"{r['err']:.1e} | {Dp4aConfig(**r['config'])} |")
    (out / "dp4a-gemv.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("\n## check failures\n" + ("\n".join(failures) if failures else "none"))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
