"""Variants of the 2-64-row kernel against the rule's own instances, side by side (issue 19).

    PYTHONPATH=plugin python -m benchmarks.mma_variants [--config NAME=FIELD=VALUE[,FIELD=VALUE...]]...
        [--variant NAME=PATCH[+PATCH...]]... [--ms 16,32,48,64] [--layers gate_up,...] [--served] [--resources]
        [--rtx-occupancy [--sms 48]] [--out DIR]

Two kinds of variant, each against "rule" (the tree's mma.cu at the configurations mma.default_config picks):
- `--config`: the rule's configurations with fields set, the tree's source: any field MmaConfig's text names
  (`warps=2`, `split=2`, `stages=3,gps=2`; the code-shape flags `flat`, `offsets`, `cstart`, `tma` take 0 or 1).
  Where a variant's configuration does not fit a shape or row count it is left out there, and the line says so.
  Without `--config` or `--variant`: the rule without tensor copies ("notma"), and with the constant start
  everywhere ("cstart") and nowhere ("nocstart"), so one run measures each flag's worth where the rule takes it
  and where it does not.
- `--variant`: the tree's mma.cu with one or more patches applied in order (`git apply`, in a temporary folder
  beside a copy of common.cuh), at the rule's configurations: an edit to try before it becomes a flag.
- `--resources` (no GPU): registers, stack bytes and SASS instructions of each instance launched at `--ms`, for
  sm_90 (the H100 / H200 rule) and sm_120 (the RTX 50 rule), per variant. A source change that leaves the maths
  alone still moves registers, and with them CTAs per SM: read this before spending device time.
- On a GPU: each variant's kernel checked against mma.gemm_reference at every layer and row count (within 1e-5, on
  a NaN-poisoned output), then timed as CUDA-graph replays over weight copies that miss L2, the variants
  alternated twice: the kernel alone (prepared rows, an ordinary launch), or with `--served` the layer as served
  (`ternary_linear` on unrotated rows with the layer's signs, the rotation + prep ahead and the mma launched early
  where the rule says; down_proj on rotated rows), each variant's bf16 output required equal to the rule's within
  1e-4 (summed in another order, a few elements round one bf16 step apart).
  Prints µs and rule ÷ variant (> 1: the variant is faster); writes mma-variants.json under --out.
- `--rtx-occupancy` (kernel alone): the RTX 50 rule (the sm120 tables) as "rule", and every launch's shared memory
  padded so that an SM of this GPU holds no more CTAs of the instance than an sm_120 SM would (benchmarks.mma_gemm's
  emulation); `--sms 48` also runs it on 48 SMs (a green context: the RTX 5070's count)."""

from __future__ import annotations

import argparse
import dataclasses
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
RULE = "rule"
TREE_SOURCE = mma.SOURCE  # the tree's own mma.cu (use() repoints mma.SOURCE at a variant)
# `--config` field names (MmaConfig.__str__'s) -> MmaConfig's fields; the code-shape flags take 0 or 1
INT_FIELDS = {name: name for name in ("warps", "rtiles", "split", "stages", "gps", "wm", "ks")}
FLAG_FIELDS = {"residual": "residual", "flat": "flat", "offsets": "row_offsets", "cstart": "const_start", "tma": "tma"}
# the rule against itself without tensor copies, and with the constant start everywhere and nowhere
DEFAULT_FLAGS = {"notma": "tma=0", "cstart": "cstart=1", "nocstart": "cstart=0"}


@dataclasses.dataclass(frozen=True)
class Variant:
    source: Path  # the mma.cu it builds from
    fields: tuple[tuple[str, bool], ...] = ()  # MmaConfig fields set over the rule's configuration

    def config(self, rule: mma.MmaConfig) -> mma.MmaConfig:
        return dataclasses.replace(rule, **dict(self.fields))


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


def parse_config(spec: str) -> Variant:
    """`NAME=FIELD=VALUE,...`'s right side: the tree's source at the rule's configurations with those fields set."""
    fields = []
    for part in spec.split(","):
        key, _, value = part.partition("=")
        if key in FLAG_FIELDS and value in ("0", "1"):
            fields.append((FLAG_FIELDS[key], value == "1"))
        elif key in INT_FIELDS and value.isdigit() and int(value) > 0:
            fields.append((INT_FIELDS[key], int(value)))
        else:
            raise SystemExit(f"--config {spec!r}: write FIELD=VALUE[,...] with FIELD one of "
                             f"{', '.join([*INT_FIELDS, *FLAG_FIELDS])} (a positive count, or 0 / 1 for "
                             f"{', '.join(FLAG_FIELDS)})")
    return Variant(TREE_SOURCE, tuple(fields))


def parse_variants(configs: list[str] | None, patches: list[str] | None) -> dict[str, Variant]:
    """The variants named on the command line (`--config`, then `--variant`; patches built now), or the default
    flag variants. Exits with a clear message where a spec is malformed or a patch does not apply."""
    out = {}
    specs = [("config", f) for f in configs or []] + [("variant", p) for p in patches or []]
    if not specs:
        specs = [("config", f"{name}={spec}") for name, spec in DEFAULT_FLAGS.items()]
    for kind, spec in specs:
        name, _, rest = spec.partition("=")
        if not rest or name == RULE:
            raise SystemExit(f"--{kind} {spec!r}: write NAME=" + ("FIELD=VALUE[,...]" if kind == "config" else
                                                                    "PATCH[+PATCH...]") + f" (NAME not {RULE!r})")
        if kind == "config":
            out[name] = parse_config(rest)
            continue
        paths = [Path(p) if Path(p).exists() else VARIANTS_DIR / p for p in rest.split("+")]
        try:
            out[name] = Variant(build(paths))
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"variant {name}: {' + '.join(map(str, paths))} does not apply to the tree's mma.cu "
                             f"({e.stderr.strip()}); regenerate the patch against it") from e
    return out


def rule_configs(ms: list[int], layers: list[str], gpu: mma.Gpu) -> dict[str, tuple[int, mma.MmaConfig]]:
    """The rule's configuration on `gpu` per "layer:rows" (rows, config), where the kernel applies."""
    shapes = {name: (k, n) for name, k, n in bk.SHAPES}
    out = {}
    for layer in layers:
        k, n = shapes[layer]
        for m in ms:
            cfg = mma.default_config(m, n, k, gpu)
            if cfg is not None:
                out[f"{layer}:{m}"] = (m, cfg)
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


def print_resources(variants: dict[str, Variant], ms: list[int], layers: list[str]) -> None:
    for arch, gpu in (("90", mma.H200), ("120", mma.RTX_5070)):
        print(f"sm_{arch} (the {'RTX 50' if gpu.rtx50 else 'H100 / H200'} rule): registers / stack bytes / SASS "
              "instructions", flush=True)
        seen = set()
        for case, (m, cfg) in rule_configs(ms, layers, gpu).items():
            names = {label: mma.template(m, v.config(cfg), torch.bfloat16) for label, v in variants.items()}
            if tuple(names.values()) in seen:
                continue
            seen.add(tuple(names.values()))
            cells = []
            for label, v in variants.items():
                try:
                    regs, stack, count = resources(v.source, names[label], arch)
                    cells.append(f"{label} {regs}/{stack}/{count}")
                except Exception as e:  # a variant that does not build for this instance says so and goes on
                    cells.append(f"{label} does not build ({str(e).splitlines()[0][:60]})")
            print(f"  {case:11s} {names[RULE]:58s} " + "   ".join(cells), flush=True)


def use(source: Path) -> None:
    mma.SOURCE = source
    mma._load.cache_clear()  # keyed by the instance's name, not its source


def time_variants(variants: dict[str, Variant], ms: list[int], layers: list[str], served: bool, out: Path,
                  rtx: bool = False, sms: int = 0) -> int:
    from bonsai_vllm.ternary.kernels import dp4a, linear

    from benchmarks.layers import served_with_signs
    from benchmarks.mma_gemm import rtx_shared

    shapes = {name: (k, n) for name, k, n in bk.SHAPES}
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    gpu = mma.Gpu.of("cuda", "sm120" if rtx else "auto")
    if sms:
        bk.on_sms(sms)
        gpu = dataclasses.replace(gpu, sms=sms)
    results, failures = {}, []
    # every instance compiled up front on the host's cores (NVRTC; compile_file caches them), not one by one below
    from concurrent.futures import ThreadPoolExecutor

    from bonsai_vllm import nvrtc

    cap = "".join(map(str, torch.cuda.get_device_capability()))
    builds = {(v.source, mma.template(m, v.config(rule), dt))
              for _, (m, rule) in rule_configs(ms, layers, gpu).items() for v in variants.values()
              for dt in (torch.bfloat16, torch.float32) if v.config(rule).fits(v.config(rule).tiles(m))}
    archs = [cap, "120"] if rtx else [cap]  # the sm_120 builds' registers set the padding
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda b: nvrtc.compile_file(b[0], b[1], b[2]), [(*b, a) for b in builds for a in archs]))
    print(f"{torch.cuda.get_device_name(0)}; µs per call ({'served' if served else 'kernel alone'}"
          + (f", sm_120 occupancy on {gpu.sms} SMs, the sm120 rule" if rtx else "") + "), rule ÷ variant in brackets",
          flush=True)
    for layer in layers:
        k, n = shapes[layer]
        copies = bk.served_copies(n, k, "cuda", seed=3, l2=l2)
        packed, scales = copies.packed, copies.scales
        tws, signs = served_with_signs(copies) if served else (None, None)
        ws = dp4a.Dp4aWorkspace("cuda")
        for m in ms:
            rule = mma.default_config(m, n, k, gpu)
            if rule is None or (served and linear.route(m, tws[0]).path != "mma"):
                continue
            configs = {label: v.config(rule) for label, v in variants.items()}
            unfit = [label for label, c in configs.items() if not c.fits(c.tiles(m)) or n % c.rows_per_cta()]
            configs = {label: c for label, c in configs.items() if label not in unfit}
            for cfg in set(configs.values()):
                mma.reserve("cuda", n, k, cfg, m)
            act = dp4a.prepare(bk.randn(m, k, device="cuda", seed=m))
            ref = mma.gemm_reference(act, packed, scales, residual=rule.residual)
            x = bk.randn(m, k, device="cuda", seed=100 + m)  # the served call's rows (unrotated where signs)
            ok, served_ref = {}, None
            for label in configs:
                v = variants[label]
                use(v.source)
                try:
                    got = mma.gemm(act, packed, scales, configs[label], ws, out=bk.nan(m, n, dtype=torch.float32),
                                   early=False)
                except nvrtc.NvrtcError as e:  # refused on the host (a tensor map, a launch): the others still run
                    print(f"{layer} M={m} {label}: {e}", flush=True)
                    ok[label] = False
                    failures.append(f"{layer} M={m} {label} (refused)")
                    continue
                ok[label] = bk.check(f"{layer} M={m} {label}", bk.rel(got, ref), 1e-5, verbose=False)
                if ok[label] and served:
                    tw = with_mma(tws[0], m, configs[label])
                    y = linear.ternary_linear(x, tw, rotated=signs is None).float()
                    served_ref = y if served_ref is None else served_ref
                    # bf16 outputs: a variant that adds K slices or warps' partial sums in another order may round
                    # a few elements one bf16 step apart (1-4e-5 of the norm measured); a wrong result is ~1
                    ok[label] = bk.check(f"{layer} M={m} {label} served", bk.rel(y, served_ref), 1e-4, verbose=False)
                if not ok[label]:
                    failures.append(f"{layer} M={m} {label}")
            y = torch.empty(m, n, device="cuda")
            times = {label: [] for label in configs if ok[label]}
            for _ in range(2):
                for label in times:
                    use(variants[label].source)
                    cfg = configs[label]
                    if served:
                        tw_v = [with_mma(tw, m, cfg) for tw in tws]
                        fn = lambda i, tw_v=tw_v: linear.ternary_linear(x, tw_v[i], rotated=signs is None)  # noqa: E731
                    else:
                        pad = rtx_shared(m, cfg) if rtx else None
                        fn = lambda i, cfg=cfg, pad=pad: mma.gemm(act, copies.tern[i][0], copies.tern[i][1], cfg,  # noqa: E731
                                                                  ws, out=y, early=False, shared_mem=pad)
                    times[label].append(bk.time_graph(fn, len(copies.tern), bk.calls_for(30)))
            med = {label: statistics.median(t) for label, t in times.items()}
            results[f"{layer}:{m}"] = {"configs": {label: str(c) for label, c in configs.items()}, "us": med}
            base = med.get(RULE)
            print(f"{layer:8s} M={m:3d} " + "  ".join(
                f"{label} {t:7.2f}" + (f" ({base / t:.3f}x)" if base and label != RULE else "")
                for label, t in med.items()) + (f"  (does not fit: {', '.join(unfit)})" if unfit else ""), flush=True)
    use(TREE_SOURCE)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mma-variants.json").write_text(json.dumps({"served": served, "results": results}, indent=1))
    for f in failures:
        print("CHECK FAILED:", f)
    return 1 if failures else 0


def with_mma(tw, rows: int, config: mma.MmaConfig):
    """A copy of the served layer `tw` whose mma route takes `config` at `rows` rows, its instance loaded now
    (not inside a graph capture)."""
    configs = list(tw.mma)
    configs[rows - 1] = config
    mma.kernel(rows, config, torch.bfloat16, tw.packed.device)
    return dataclasses.replace(tw, mma=tuple(configs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", help="NAME=FIELD=VALUE[,...]: the rule's configurations with these "
                    f"fields set ({', '.join([*INT_FIELDS, *FLAG_FIELDS])}); default: "
                    + ", ".join(f"{k}={v}" for k, v in DEFAULT_FLAGS.items()))
    ap.add_argument("--variant", action="append", help="NAME=PATCH[+PATCH...]: the tree's mma.cu with patches "
                    f"applied (paths, or names in benchmarks/{VARIANTS_DIR.name}/)")
    ap.add_argument("--ms", default="16,24,32,48,64")
    ap.add_argument("--layers", default=",".join(s[0] for s in bk.SHAPES))
    ap.add_argument("--served", action="store_true", help="time the layer as served (ternary_linear), not the kernel")
    ap.add_argument("--resources", action="store_true", help="registers and instructions only (no GPU)")
    ap.add_argument("--rtx-occupancy", action="store_true", help="the sm120 rule, each launch padded to an sm_120 "
                    "SM's CTAs per SM (kernel alone)")
    ap.add_argument("--sms", type=int, default=0, help="time on this many SMs (a green context; 48: the RTX 5070)")
    ap.add_argument("--out", default=os.environ.get("OUT", ".cache/bench-mma-variants"))
    args = ap.parse_args(argv)
    ms, layers = [int(v) for v in args.ms.split(",")], args.layers.split(",")
    variants = {RULE: Variant(TREE_SOURCE), **parse_variants(args.config, args.variant)}
    if args.resources:
        print_resources(variants, ms, layers)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("mma_variants: timing needs a CUDA GPU (--resources runs without one)")
    if args.rtx_occupancy and args.served:
        raise SystemExit("mma_variants: --rtx-occupancy pads the kernel's own launch; it does not apply to --served")
    return time_variants(variants, ms, layers, args.served, Path(args.out), args.rtx_occupancy, args.sms)


if __name__ == "__main__":
    raise SystemExit(main())
