"""Variants of the 2-64-row kernel (mma.cu with patches applied) against the tree's own, side by side (issue 19).

    PYTHONPATH=plugin python -m benchmarks.mma_variants [--variant NAME=PATCH[+PATCH...]]... [--ms 16,32,48,64]
        [--layers gate_up,...] [--resources] [--out DIR]

A variant is the tree's mma.cu with one or more patches applied in order (`git apply`, in a temporary folder beside
a copy of common.cuh); without `--variant`, the patches kept in benchmarks/variants/ (docs/dev-notes.md says what
each changes and why it was not taken yet). The rule (mma.default_config) picks the configuration, so every variant
runs the same template instances.
- `--resources` (no GPU): registers, stack bytes and SASS instructions of each instance the rule launches at
  `--ms`, for sm_90 (the H100 / H200 rule) and sm_120 (the RTX 50 rule), per variant. A source change that leaves
  the maths alone still moves registers, and with them CTAs per SM: read this before spending device time.
- On a GPU: each variant checked against mma.gemm_reference at every layer and row count (within 1e-5, on a
  NaN-poisoned output), then the kernel alone timed (prepared rows, an ordinary launch) as CUDA-graph replays over
  weight copies that miss L2, the variants alternated twice; prints µs and tree ÷ variant (> 1: the variant is
  faster) and writes mma-variants.json under --out."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from benchmarks import kernels as bk
from bonsai_vllm.ternary.kernels import mma

VARIANTS_DIR = Path(__file__).with_name("variants")
# name -> the patches, applied in this order to the tree's mma.cu
DEFAULT_VARIANTS = {
    "offsets": ["mma-copy-offsets.patch"],
    "offsets+constant": ["mma-copy-offsets.patch", "mma-constant-start.patch"],
}
TREE = "tree"
TREE_SOURCE = mma.SOURCE  # the tree's own mma.cu (use() repoints mma.SOURCE at a variant)


def build(patches: list[Path]) -> Path:
    """A copy of the tree's mma.cu (and its header) with `patches` applied: the new source's path. Raises
    CalledProcessError, with git's message, where a patch no longer applies."""
    folder = Path(tempfile.mkdtemp(prefix="mma-variant-"))
    shutil.copy(TREE_SOURCE, folder / "mma.cu")
    shutil.copy(TREE_SOURCE.with_name("common.cuh"), folder / "common.cuh")
    for patch in patches:
        subprocess.run(["git", "apply", str(Path(patch).resolve())], cwd=folder, check=True, capture_output=True,
                       text=True)
    return folder / "mma.cu"


def parse_variants(specs: list[str] | None) -> dict[str, list[Path]]:
    if not specs:
        return {name: [VARIANTS_DIR / p for p in ps] for name, ps in DEFAULT_VARIANTS.items()}
    out = {}
    for spec in specs:
        name, _, patches = spec.partition("=")
        if not patches:
            raise SystemExit(f"--variant {spec!r}: write NAME=PATCH[+PATCH...]")
        out[name] = [Path(p) if Path(p).exists() else VARIANTS_DIR / p for p in patches.split("+")]
    return out


def instances(ms: list[int], layers: list[str], gpu: mma.Gpu) -> dict[str, str]:
    """The template names the rule launches on `gpu` (bf16 out, as served), keyed "layer:rows"."""
    shapes = {name: (k, n) for name, k, n in bk.SHAPES}
    out = {}
    for layer in layers:
        k, n = shapes[layer]
        for m in ms:
            cfg = mma.default_config(m, n, k, gpu)
            if cfg is not None:
                out[f"{layer}:{m}"] = mma.template(m, cfg, torch.bfloat16)
    return out


def resources(source: Path, name: str, arch: str) -> tuple[int, int, int]:
    """(registers, stack + local bytes, SASS instructions) of one instance built from `source`."""
    import re

    from bonsai_vllm import nvrtc
    from tools.compile_check import dump_cubin
    from tools.compile_check import resources as read_resources

    cubin, _ = nvrtc.compile_file(source, name, arch)
    res = read_resources(cubin)
    count = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", dump_cubin(cubin, "-sass")))
    return res.registers, res.spill_bytes, count


def print_resources(sources: dict[str, Path], ms: list[int], layers: list[str]) -> None:
    for arch, gpu in (("90", mma.H200), ("120", mma.RTX_5070)):
        print(f"sm_{arch} (the {'RTX 50' if gpu.rtx50 else 'H100 / H200'} rule): registers / stack bytes / SASS "
              "instructions", flush=True)
        seen = set()
        for case, name in instances(ms, layers, gpu).items():
            if name in seen:
                continue
            seen.add(name)
            cells = []
            for label, src in sources.items():
                try:
                    regs, stack, count = resources(src, name, arch)
                    cells.append(f"{label} {regs}/{stack}/{count}")
                except Exception as e:  # a variant that does not build for this instance says so and goes on
                    cells.append(f"{label} does not build ({str(e).splitlines()[0][:60]})")
            print(f"  {case:11s} {name:50s} " + "   ".join(cells), flush=True)


def use(source: Path) -> None:
    mma.SOURCE = source
    mma._load.cache_clear()  # keyed by the instance's name, not its source


def time_variants(sources: dict[str, Path], ms: list[int], layers: list[str], out: Path) -> int:
    from bonsai_vllm.ternary.kernels import dp4a

    shapes = {name: (k, n) for name, k, n in bk.SHAPES}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    gpu = mma.Gpu.of("cuda")
    results, failures = {}, []
    print(f"{torch.cuda.get_device_name(0)}; µs per call, tree ÷ variant in brackets", flush=True)
    for layer in layers:
        k, n = shapes[layer]
        packed, scales, _ = bk.random_layer(n, k, "cuda", seed=3)
        nbytes = n * k / 4 + n * k / 64
        copies = [(packed.clone(), scales.clone()) for _ in range(bk.n_copies(int(nbytes), l2))]
        ws = dp4a.Dp4aWorkspace("cuda")
        for m in ms:
            cfg = mma.default_config(m, n, k, gpu)
            if cfg is None:
                continue
            mma.reserve("cuda", n, k, cfg, m)
            act = dp4a.prepare(bk.randn(m, k, device="cuda", seed=m))
            ref = mma.gemm_reference(act, packed, scales, residual=cfg.residual)
            ok = {}
            for label, src in sources.items():
                use(src)
                got = mma.gemm(act, packed, scales, cfg, ws, out=bk.nan(m, n, dtype=torch.float32), early=False)
                ok[label] = bk.check(f"{layer} M={m} {label}", bk.rel(got, ref), 1e-5, verbose=False)
                if not ok[label]:
                    failures.append(f"{layer} M={m} {label}")
            y = torch.empty(m, n, device="cuda")
            times = {label: [] for label in sources if ok[label]}
            for _ in range(2):
                for label in times:
                    use(sources[label])
                    times[label].append(bk.time_graph(
                        lambda i: mma.gemm(act, copies[i][0], copies[i][1], cfg, ws, out=y, early=False),
                        len(copies), bk.calls_for(30)))
            med = {label: statistics.median(t) for label, t in times.items()}
            results[f"{layer}:{m}"] = {"config": str(cfg), "us": med}
            base = med.get(TREE)
            print(f"{layer:8s} M={m:3d} " + "  ".join(
                f"{label} {t:7.2f}" + (f" ({base / t:.3f}x)" if base and label != TREE else "")
                for label, t in med.items()), flush=True)
    use(TREE_SOURCE)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mma-variants.json").write_text(json.dumps(results, indent=1))
    for f in failures:
        print("CHECK FAILED:", f)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", help="NAME=PATCH[+PATCH...] (paths, or names in "
                    f"{VARIANTS_DIR.name}/); default: {', '.join(DEFAULT_VARIANTS)}")
    ap.add_argument("--ms", default="16,24,32,48,64")
    ap.add_argument("--layers", default=",".join(s[0] for s in bk.SHAPES))
    ap.add_argument("--resources", action="store_true", help="registers and instructions only (no GPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", ".cache/bench-mma-variants"))
    args = ap.parse_args(argv)
    ms, layers = [int(v) for v in args.ms.split(",")], args.layers.split(",")
    sources = {TREE: TREE_SOURCE}
    for name, patches in parse_variants(args.variant).items():
        try:
            sources[name] = build(patches)
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"variant {name}: {' + '.join(map(str, patches))} does not apply to the tree's mma.cu "
                             f"({e.stderr.strip()}); regenerate the patch against it") from e
    if args.resources:
        print_resources(sources, ms, layers)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("mma_variants: timing needs a CUDA GPU (--resources runs without one)")
    return time_variants(sources, ms, layers, Path(args.out))


if __name__ == "__main__":
    raise SystemExit(main())
