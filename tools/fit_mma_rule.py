"""Fit the mma kernel's table entries (ternary/kernels/mma.py) from `bench-mma` sweeps: per layer class and
column tiles, the fastest configuration whose build for the target GPU does not spill.

    PYTHONPATH=plugin python -m tools.fit_mma_rule RUN1/mma-gemm.json [RUN2/mma-gemm.json ...] [--target 120]

`python -m benchmarks.mma_gemm` (with `--rtx-occupancy --sms 48` for the RTX 5070) writes each configuration's µs
per layer and row count. Here, for each class (`mma.layer_class`) and column-tile count T (8 batch rows each), a
configuration is scored by its time over the fastest one's, summed over the class's layers swept at that T
(a configuration some of them did not time is out), and the lowest score whose instance builds without spills for
`--target` (NVRTC + cuobjdump, as `make compile-check`; no GPU) becomes the entry. Its K slices become "CTAs per
SM" on the SMs the sweep ran on (the JSON's `sms`), the form the tables take; a count no such aim gives (three,
say: `mma.k_slices` makes powers of two) is printed for `mma._FIXED_SLICES`. A later file's point replaces an
earlier one's. The output is the entries as Python (paste into the tables by hand: the tables' comments say
which sweep each came from) and a table of each layer's loss against its own best and against today's rule.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bonsai_vllm.ternary.kernels import mma
from bonsai_vllm.ternary.kernels.dp4a import GROUP
from bonsai_vllm.ternary.kernels.mma import MmaConfig

Entry = tuple  # (warps, rtiles, stages, gps, wm, CTAs per SM, fewest groups per slice[, ks]): one row of mma's tables


@dataclass
class Point:
    """One (layer, rows) sweep: µs per configuration."""

    layer: str
    n: int
    k: int
    m: int
    sms: int
    times: dict[MmaConfig, float]

    @property
    def best_us(self) -> float:
        return min(self.times.values())


@dataclass
class Fit:
    cls: str
    tiles: int
    config: MmaConfig  # as swept (its split taken on `sms` SMs)
    entry: Entry
    fixed: int | None  # K slices for mma._FIXED_SLICES where no aim of the entry gives them
    losses: dict[str, float]  # layer -> the chosen config's time over that layer's best
    skipped: list[str]  # faster configurations refused for spilling


def load(paths: list[Path], sms: int = mma.H200.sms) -> list[Point]:
    """The sweeps' points; `sms` for rows written before bench-mma recorded the SMs it ran on."""
    points: dict[tuple[str, int], Point] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text())["rows"]:
            points[(row["layer"], row["M"])] = Point(
                row["layer"], row["N"], row["K"], row["M"], int(row.get("sms", sms)),
                {MmaConfig.parse(text): us for text, us in row["all"].items()})
    return list(points.values())


def slice_aim(config: MmaConfig, n: int, k: int, sms: int) -> tuple[float, int] | None:
    """(CTAs per SM, fewest groups per slice): the aim that makes `mma.k_slices` give `config`'s K slices for an
    [N, K] layer on `sms` SMs; None where no aim does (k_slices makes powers of two only: three slices, say), so
    the tables name the count in `mma._FIXED_SLICES` instead."""
    groups, row_tiles = k // GROUP, n // config.rows_per_cta()
    if config.split == 1:
        return 0, 2
    # the slices double while row_tiles · split < per_sm · sms: aim at exactly row_tiles · split CTAs
    per_sm, min_groups = row_tiles * config.split / sms, groups // config.split
    per_sm = int(per_sm) if per_sm == int(per_sm) else round(per_sm, 3)
    return (per_sm, min_groups) if mma.k_slices(row_tiles, groups, per_sm, min_groups, sms) == config.split else None


def entry(config: MmaConfig, n: int, k: int, sms: int) -> Entry:
    """The table row that gives `config`'s layout for an [N, K] layer on `sms` SMs, its K slices included where an
    aim gives them (else one slice by the aim, and `fixed_slices` names the count)."""
    per_sm, min_groups = slice_aim(config, n, k, sms) or (0, 2)
    row = (config.warps, config.rtiles, config.stages, config.gps, config.wm, per_sm, min_groups)
    return row + (config.ks,) if config.ks > 1 else row


def fixed_slices(config: MmaConfig, n: int, k: int, sms: int) -> int | None:
    """`config`'s K slices where the table must name them (`mma._FIXED_SLICES`), else None."""
    return None if slice_aim(config, n, k, sms) else config.split


def spills_on(target: int) -> Callable[[int, MmaConfig], bool]:
    """Whether the instance for m rows spills (stack or local memory) when built for sm_<target>."""
    import torch

    from tools.compile_check import resources

    def spills(m: int, config: MmaConfig) -> bool:
        return any(resources(mma.compile_instance(mma.template(m, config, dt), str(target))[0]).spill_bytes
                   for dt in (torch.bfloat16, torch.float32))

    return spills


def fit(points: list[Point], spills: Callable[[int, MmaConfig], bool]) -> list[Fit]:
    by_slot: dict[tuple[str, int], list[Point]] = defaultdict(list)
    for p in points:
        by_slot[(mma.layer_class(p.n, p.k), -(-p.m // 8))].append(p)
    fits = []
    for (cls, tiles), group in sorted(by_slot.items()):
        common = set.intersection(*(set(p.times) for p in group))
        score = {c: sum(p.times[c] / p.best_us for p in group) for c in common}
        skipped = []
        for config in sorted(common, key=score.get):
            if any(spills(p.m, config) for p in group):
                skipped.append(str(config))
                continue
            first = group[0]
            fits.append(Fit(cls, tiles, config, entry(config, first.n, first.k, first.sms),
                            fixed_slices(config, first.n, first.k, first.sms),
                            {p.layer: p.times[config] / p.best_us for p in group}, skipped))
            break
    return fits


def report(fits: list[Fit], points: list[Point], target: int) -> str:
    lines = ["| class | T | entry | config (as swept) | time ÷ best per layer | today's rule ÷ best | spilled, skipped |",
             "|---|---|---|---|---|---|---|"]
    for f in fits:
        today = []
        for p in points:
            if mma.layer_class(p.n, p.k) == f.cls and -(-p.m // 8) == f.tiles:
                rule = mma.default_config(p.m, p.n, p.k, mma.Gpu(target, p.sms))
                today.append(f"{p.layer} {p.times[rule] / p.best_us:.2f}" if rule in p.times else f"{p.layer} -")
        losses = ", ".join(f"{layer} {v:.2f}" for layer, v in f.losses.items())
        lines.append(f"| {f.cls} | {f.tiles} | {f.entry} | {f.config} | {losses} | {', '.join(today)} | "
                     f"{len(f.skipped)} |")
    tables, fixed = defaultdict(dict), defaultdict(dict)
    for f in fits:
        tables[f.cls][f.tiles] = f.entry
        if f.fixed:
            fixed[f.cls][f.tiles] = f.fixed
    lines.append("")
    lines += [f"{cls}: {dict(sorted(t.items()))}" for cls, t in sorted(tables.items())]
    if fixed:
        lines.append(f"_FIXED_SLICES: {dict(sorted((cls, dict(sorted(t.items()))) for cls, t in fixed.items()))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", nargs="+", type=Path, help="mma-gemm.json files of bench-mma runs")
    ap.add_argument("--target", type=int, default=120, help="compute capability the entries are for (90 or 120)")
    ap.add_argument("--sms", type=int, default=mma.H200.sms,
                    help="SMs of sweeps whose JSON does not record them (bench-mma before --sms: 132)")
    args = ap.parse_args(argv)
    points = load(args.sweeps, args.sms)
    print(report(fit(points, spills_on(args.target)), points, args.target))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
