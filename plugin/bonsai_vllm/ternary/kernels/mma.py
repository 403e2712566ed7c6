"""The ternary layer for 2 to 64 rows on int8 tensor cores, codes decoded in registers (issue 19): `mma.cu`.

Why CUDA and not Triton: every Triton route tried fed decoded codes to `tl.dot` through shared memory, per
tile, behind barriers (docs/dev-notes.md: the codes GEMM at 88 µs against bf16's 46 for gate_up at 16 rows).
In `mma.cu` each thread decodes its own operand registers from the checkpoint's words (two instructions per
four weights) and issues `mma.sync.m16n8k32.s8` itself, while a pipeline (cp.async per thread, or on most of the
sm_90 rule's instances one tensor copy per operand and stage: MmaConfig.tma) keeps the next stages' codes
and activations in flight into shared memory; the file's first comment explains the layout.

It is compiled at run time by NVRTC (bonsai_vllm.nvrtc: the CUDA runtime compiler that PyTorch's CUDA wheels
carry), for the GPU it runs on, once per template instance and process: the serving image needs no nvcc, and
`make compile-check` compiles it for sm_90 and sm_120 on a machine without a GPU.

    config = default_config(m, n, k, Gpu.of(device))  # once per layer and row count, at load
    act = dp4a.prepare(xr)                # or rotate_prep.rotate_prep(x, signs): the activations' int8 and scales
    y = gemm(act, packed, scales, config, workspace, out=y)

The judge is `gemm_reference` (the integer maths of dp4a.gemv_reference, batched, the residual term
optional), and behind it the float32 layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bonsai_vllm import nvrtc
from bonsai_vllm.ternary.kernels.dp4a import (GROUP, PREP_CUDA_ROTATION, PREP_DP4A, PREP_NORM_ROTATION,
                                              PREP_ROTATION, Dp4aActivations, unplanar)

SOURCE = Path(__file__).with_name("mma.cu")
MAX_ROWS = 64  # batch rows one launch takes (8 per mma column tile, T <= 8)
_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class MmaConfig:
    """How one layer's call is cut up (mma.cu's template and grid)."""

    warps: int  # warps along the output rows (a CTA covers 16 · rtiles · warps output rows)
    rtiles: int  # 16-row tiles of W per warp
    split: int  # slices of K (CTAs along K); > 1: partial sums, added by the tile's last CTA in slice order
    residual: bool  # also the r8 term: x to ~2e-5 instead of int8's ~6e-3
    stages: int = 4  # shared-memory stages of the cp.async pipeline (stages - 1 in flight)
    gps: int = 1  # groups of 128 inputs per stage (1, 2 or 4)
    wm: int = 1  # warps along the batch: each takes 1/wm of the column tiles
    ks: int = 1  # warps along K inside the CTA: each takes every ks-th group of a stage (warps · wm · ks warps)
    flat: bool = False  # a whole stage's groups with no branch between them (more registers; mma.cu's FLAT)
    row_offsets: bool = False  # copies addressed by byte offsets from one pointer per stage (mma.cu's ROW_OFFSETS)
    const_start: bool = False  # every mma started from a constant (mma.cu's CONST_START)
    tma: bool = False  # codes and activations by tensor copies, one thread's per stage (mma.cu's TMA; sm_90+)

    def __str__(self) -> str:
        return (f"warps={self.warps} rtiles={self.rtiles} split={self.split} residual={int(self.residual)} "
                f"stages={self.stages} gps={self.gps}" + (f" wm={self.wm}" if self.wm > 1 else "")
                + (f" ks={self.ks}" if self.ks > 1 else "") + (" flat=1" if self.flat else "")
                + (" offsets=1" if self.row_offsets else "") + (" cstart=1" if self.const_start else "")
                + (" tma=1" if self.tma else ""))

    @classmethod
    def parse(cls, text: str) -> "MmaConfig":
        """The configuration `str(config)` printed (bench-mma's JSON keys its timings by it)."""
        fields = dict(part.split("=") for part in text.split())
        return cls(warps=int(fields["warps"]), rtiles=int(fields["rtiles"]), split=int(fields["split"]),
                   residual=fields["residual"] == "1", stages=int(fields["stages"]), gps=int(fields["gps"]),
                   wm=int(fields.get("wm", 1)), ks=int(fields.get("ks", 1)), flat=fields.get("flat") == "1",
                   row_offsets=fields.get("offsets") == "1", const_start=fields.get("cstart") == "1",
                   tma=fields.get("tma") == "1")

    def tiles(self, m: int) -> int:
        """Column tiles of the instance that runs m rows: 8 rows each, rounded up to a multiple of wm, and seven
        up to eight (the seven-tile instance ran 1.04-1.15x slower than the eight-tile one on the H200 at every
        layer, docs/benchmarks.md). The padding's columns are multiplied and never stored (batch rows past M are
        not even copied in)."""
        t = -(-m // (8 * self.wm)) * self.wm
        return 8 if t == 7 else t

    def rows_per_cta(self) -> int:
        return 16 * self.rtiles * self.warps

    def shared_bytes(self, tiles: int) -> int:
        """Dynamic shared memory for `tiles` column tiles of 8 batch rows (mma.cu's PipeStage · stages): the
        launch's size, which the kernel checks against its own sizeof (it traps on too little). With tensor
        copies (tma) the stages are 1024-byte aligned and the launch adds 1 KB to align the first."""
        res = int(self.residual)
        pitch = 8 * self.gps + (4 if self.gps == 4 and not self.tma else 0)  # PipeStage::CWP
        words = (self.rows_per_cta() * pitch + (1 + res) * 8 * tiles * 4 * 8 * self.gps
                 + self.gps * (2 + 2 * res) * 8 * tiles + self.rows_per_cta() * (self.gps // 2 + 1))
        stage = -(-4 * words // 1024) * 1024 if self.tma else 4 * words
        # with warps along K, the partial tiles they add at the end (mma.cu's RED_BYTES), over the stages' bytes
        reduction = (self.ks - 1) * self.rtiles * (tiles // self.wm) * 4 * 32 * self.warps * self.wm * 4
        return max(self.stages * stage, reduction) + (1024 if self.tma else 0)

    def threads(self) -> int:
        return 32 * self.warps * self.wm * self.ks

    def fits(self, tiles: int) -> bool:
        barriers = 8 * self.stages if self.tma else 0  # tma: an mbarrier per stage, in static shared memory
        return (tiles % self.wm == 0 and self.gps % self.ks == 0 and self.threads() <= 1024
                and self.shared_bytes(tiles) + barriers <= SHARED_MAX
                # a tensor copy's box: at most 256 rows (the codes' CTA rows; the activations' 32 per tile)
                and (not self.tma or (self.rows_per_cta() <= 256 and tiles <= 8)))


# Dynamic shared memory of one CTA: sm_120's opt-in limit per block (99 KB; the H200's is 227 KB), less the
# 16 bytes of write_tile's static flag. Above 48 KB the kernel is opted in once at load (nvrtc.allow_shared).
SHARED_MAX = 99 * 1024 - 16
SHARED_DEFAULT = 48 * 1024  # what a launch gets without opting in
# Launch as a programmatic dependent of the prep kernel by default (benchmarks/mma_gemm.py and stream_gemv.py
# measure it against an ordinary launch).
EARLY_LAUNCH = True

# Batch rows up to which the residual term runs: on the H200 (benchmarks/mma_gemm.py, docs/benchmarks.md) it
# costs 1.05-1.3x the plain kernel there and still beats the route it replaces at every shape; plain int8
# activations (error ~6.5e-3 against float32, the served int8 prefill route's kind) above.
RESIDUAL_MAX_M = 8


@dataclass(frozen=True)
class Gpu:
    """What the rule asks of the GPU a layer runs on: its architecture (which tables) and its SMs (how many K
    slices fill it)."""

    capability: int  # 10 · major + minor: 90 the H100 / H200, 120 the RTX 50 series
    sms: int

    @property
    def rtx50(self) -> bool:
        """sm_120 / sm_121: 100 KB of shared memory and 1,536 threads per SM, so fewer CTAs of each instance
        at once than on the H200 (228 KB, 2,048), and far fewer SMs: the instances rank differently there."""
        return self.capability // 10 == 12

    @classmethod
    def of(cls, device: torch.device | str, rule: str = "auto") -> "Gpu":
        """The GPU of `device`; `rule` "sm90" or "sm120" takes that architecture's tables instead of the
        device's own (BONSAI_MMA_RULE: the sm_120 rule checked on an H200, or an untried GPU)."""
        index = torch.device(device).index or 0
        major, minor = nvrtc.capability(index)
        capability = 10 * major + minor if rule == "auto" else int(rule.removeprefix("sm"))
        return cls(capability, nvrtc.sm_count(index))


H200 = Gpu(90, 132)
RTX_5070 = Gpu(120, 48)  # the target card of a 12 GB pair (docs/benchmarks.md's RTX model)

# Per column tiles T (8 batch rows each) and layer class: (warps along the output rows, row tiles per warp,
# stages, groups per stage, warps along the batch, CTAs per SM the K slices aim for, fewest groups of 128 in a
# slice[, warps along K inside the CTA: 1 when left out]).
#
# The H200's tables, from its sweeps (benchmarks/mma_gemm.py, 6 shapes, docs/benchmarks.md). Up to 24 rows (the
# lean-copy kernel's sweep, static shared memory): two stages of four groups on four warps, and from 9 rows one K
# slice except on the deep layer (down_proj, 68 groups: 1.05-1.26x faster with 4-8 slices). From 25 rows (the
# sweep of the configurations past the static 48 KB, eleventh session): still two stages of four groups, now in
# up to 99 KB of dynamic shared memory, 1.06-1.49x faster than the one-group stages before; warps along the batch
# on all but the wide layer (gate_up, whose CTAs are many enough: one batch warp, two 16-row tiles per warp at
# 41-48 rows), and three stages at 33-40 rows (five column tiles, no batch split). At 25-32 rows the other layers
# take two batch warps, within 0.5 % of four, whose sm_120 build spills 8 bytes. Per row count and class the rule
# is the sweep's fastest configuration (the classes' other layers within 1 %). The shallow layers rank as the
# other class does. Warps along K inside the CTA (eighteenth session, the served call behind the rotation + prep
# kernel): two at 17-24 rows on qkv / GDN-in / o_proj / GDN-out (1.13-1.15x faster), four with one batch warp at
# 25-32 rows (1.05x against the two batch warps before), two on gate_up at 41-48 rows with 32-row warps of two
# tiles (1.04-1.08x); elsewhere they lost (up to 3x at 8 rows, where a stage's four groups split too thin) or
# were level served (33-40 rows, three stages; see docs/dev-notes.md). Beside tensor copies (twenty-fourth session),
# down_proj at 17-24 rows takes 32-row CTAs (two warps): 1.07-1.08x served on an H100, 0.82-0.88x at 9-16 rows.
_OTHER = {1: (4, 1, 2, 4, 1, 3, 4), 2: (4, 1, 2, 4, 1, 0, 2), 3: (4, 1, 2, 4, 1, 0, 2, 2), 4: (4, 1, 2, 4, 1, 0, 2, 4),
          5: (4, 1, 3, 4, 1, 0, 2), 6: (4, 1, 2, 4, 3, 0, 2), 7: (4, 1, 2, 4, 2, 0, 2), 8: (4, 1, 2, 4, 2, 0, 2)}
# The 32-row warps of two 16-row tiles with two warps along K (gate_up's 41-48-row layout), re-swept at the
# neighbouring row counts with tensor copies, served on an H200 (docs/benchmarks.md, issue 19):
# - gate_up (and the LM head): at 49-64 rows 1.13-1.17x over four warps of one tile with two batch warps (twenty-
#   sixth session), at 25-40 rows 1.04-1.06x over four warps of one tile (twenty-seventh).
# - qkv / GDN-in (twenty-seventh): 1.08x at 33-40 rows (three stages kept), 1.09-1.11x at 49-64 over four warps
#   of one tile with two batch warps; at 41-48 rows, where that layout spills, two batch warps of one-tile warps
#   ran 1.04-1.05x faster than three.
# - o_proj / GDN-out (twenty-seventh): 1.10-1.12x at 33-40 rows (three stages, now with tensor copies) over four
#   warps of one tile without them; from 41 rows the two-tile warps with two batch warps instead of warps along K,
#   1.09x at 41-48 and 1.04-1.05x at 49-64.
# - down_proj at 33-40 rows runs its 41-48-row instance, three batch warps over six column tiles (1.18-1.19x over
#   three stages on five, with the three K slices of _FIXED_SLICES; twenty-sixth).
# Where they lost: the two-tile layout on qkv / o_proj at 25-32 rows (0.79-0.92x), with K warps on o_proj at 41-48
# (0.98x) and on qkv there (0.87x, it spills); K slices other than the rule's on down_proj at 17-32 rows; the two-
# tile warps with two batch warps at 12-24 rows on every layer (0.85-0.94x, twenty-ninth; on down_proj at 36-48 rows
# every two-tile layout, 0.82-0.88x). down_proj at 49-64 rows runs two-tile warps with four batch warps (three K
# slices): 1.04x over four one-tile warps served, on an H100 (twenty-ninth) and an H200 (thirty-first). Timed as
# built: the sm_90 builds with K warps keep 24 bytes of stack at 33-40 rows (five tiles; qkv, gate_up) and 32 at
# 41-48 (gate_up), and won with them.
_WIDE = {**_OTHER, 3: (4, 1, 2, 4, 1, 0, 2), 4: (2, 2, 2, 4, 1, 0, 2, 2), 5: (2, 2, 2, 4, 1, 0, 2, 2),
         6: (2, 2, 2, 4, 1, 0, 2, 2), 7: (2, 2, 2, 4, 1, 0, 2, 2), 8: (2, 2, 2, 4, 1, 0, 2, 2)}
_QKV = {**_OTHER, 5: (2, 2, 3, 4, 1, 0, 2, 2), 6: (4, 1, 2, 4, 2, 0, 2), 7: (2, 2, 2, 4, 1, 0, 2, 2),
        8: (2, 2, 2, 4, 1, 0, 2, 2)}  # the "other" class: qkv, GDN-in
_SHALLOW = {**_OTHER, 5: (2, 2, 3, 4, 1, 0, 2, 2), 6: (2, 2, 2, 4, 2, 0, 2), 7: (2, 2, 2, 4, 2, 0, 2),
            8: (2, 2, 2, 4, 2, 0, 2)}  # o_proj, GDN-out
_DEEP = {**_OTHER, 2: (4, 1, 2, 4, 1, 8, 6), 3: (2, 1, 2, 4, 1, 8, 12), 4: (4, 1, 2, 4, 2, 8, 6),
         5: (4, 1, 2, 4, 3, 8, 6), 6: (4, 1, 2, 4, 3, 8, 6), 7: (2, 2, 2, 4, 4, 8, 6), 8: (2, 2, 2, 4, 4, 8, 6)}
# The RTX 50's tables, from sweeps on the H200 with each launch's shared memory padded so that an SM holds as
# many CTAs of the instance as an sm_120 SM would (`bench-mma --rtx-occupancy`), on 48 SMs (`--sms 48`, a green
# context: the RTX 5070's count); per class and column tiles the fastest configuration whose sm_120 build does
# not spill (`python -m tools.fit_mma_rule` on the sweeps' JSON prints these entries). Up to 24 rows (fourteenth
# session): one K slice won on every layer but qkv at 17-24 rows, and two 16-row tiles per warp at 17-24 rows on
# all but qkv. From 25 rows (sixteenth session; swept at 32, 40, 48, 56 and 64 rows): one K slice everywhere and
# 128-row CTAs (two row tiles per warp) on all but qkv at 33-40 and 49-64 rows; the deep, wide and shallow layers
# (down_proj, gate_up, o_proj) chose the same entries, 1.0-1.10x their own best, where the 132-SM padded sweep's
# entries before were up to 1.41x off. At 33-40 rows the faster two-stage, four-group 128-row CTA spills on
# sm_120, so eight warps of one tile take it. At 49-56 rows the first sweep left out every configuration with
# batch warps (it checked them at seven column tiles, which two warps do not divide, though they run the
# eight-tile instance): the 57-64-row entry runs that same instance, 1.15-1.19x faster at 56 rows than that
# sweep's best, and the corrected sweep at 56 rows (down_proj, o_proj) found nothing faster. Warps along K
# (nineteenth session, a sweep of them at 20, 24 and 32 rows beside the tables' entries): two on qkv / GDN-in at
# 17-24 rows and four on two-warp CTAs at 25-32 (1.02-1.04x); on down_proj and o_proj the entries stayed fastest, and
# gate_up lost 1.13x at 20 rows. Only the H200's bandwidth and clocks stay of the H200.
_RTX_OTHER = {1: (2, 1, 2, 4, 1, 0, 2), 2: (2, 1, 2, 4, 1, 0, 2), 3: (4, 1, 2, 4, 1, 0, 2, 2),
              4: (2, 1, 2, 4, 1, 0, 2, 4), 5: (4, 1, 3, 4, 1, 0, 2), 6: (4, 2, 4, 1, 1, 0, 2), 7: (4, 1, 2, 4, 2, 0, 2), 8: (4, 1, 2, 4, 2, 0, 2)}
_RTX_FROM_25 = {4: (4, 2, 2, 4, 1, 0, 2), 5: (8, 1, 2, 4, 1, 0, 2), 6: (4, 2, 2, 4, 2, 0, 2), 7: (4, 2, 3, 2, 2, 0, 2),
                8: (4, 2, 3, 2, 2, 0, 2)}  # 25-64 rows on the deep, wide and shallow layers
_RTX_SHALLOW = {**_RTX_OTHER, **_RTX_FROM_25, 1: (8, 1, 3, 4, 1, 0, 2), 2: (4, 2, 3, 4, 1, 0, 2),
                3: (4, 2, 2, 4, 1, 0, 2), 4: (4, 2, 2, 4, 2, 0, 2)}
_RTX_WIDE = {**_RTX_OTHER, **_RTX_FROM_25, 1: (4, 1, 2, 4, 1, 0, 2), 2: (4, 1, 2, 4, 1, 0, 2), 3: (4, 2, 2, 4, 1, 0, 2)}
_RTX_DEEP = {**_RTX_OTHER, **_RTX_FROM_25, 1: (8, 1, 3, 4, 1, 0, 2), 2: (4, 1, 2, 4, 1, 0, 2), 3: (4, 2, 2, 4, 1, 0, 2)}
# Column tiles T at which the table's instance runs each stage's groups with no branch between them (MmaConfig.flat):
# where that was 1.02-1.10x faster than the per-group blocks, served and alone, on an H100 (twenty-second session,
# docs/benchmarks.md). Elsewhere the registers it adds lost up to 1.25x (gate_up at 41-48 rows: 192 registers
# against 168, two CTAs per SM instead of three; down_proj from 25 rows). Not on the RTX 50's tables: unmeasured.
_FLAT = {False: {"wide": {2, 3, 7, 8}, "deep": {2, 3}, "other": {7, 8}, "shallow": {7, 8}}, True: {}}
# Column tiles T at which the table's instance takes its codes and activations by tensor copies (MmaConfig.tma): one
# bulk copy per operand and stage, issued by one thread, in place of about 13 cp.async per thread and their address
# arithmetic. Against the same instances without them, served (twenty-fourth session, docs/benchmarks.md): on an H100
# 1.03-1.22x faster at 6-64 rows on gate_up and down_proj and at 16-64 on the other layers, level at 6-8 rows on
# those; on an H200, the final rule, 1.03-1.39x. Not taken where it was level or slower: one column tile on qkv /
# GDN-in / o_proj (and until the twenty-seventh session o_proj's four-warp three-stage instance at 33-40 rows,
# 0.97-0.99x; its two-tile warps take them). The RTX 50's tables take them everywhere, with the constant start:
# on the 48-SM emulation at sm_120 occupancy, the pair ran 1.01-1.36x faster than the tables' instances without
# them at 8-64 rows on all four classes (tensor copies alone: 0.88-1.28x), because the sm_120 builds lose
# registers with them and an SM then holds more CTAs. That is an emulation on an H100: no RTX 50 card has run them
# (BONSAI_MMA_TMA=0 turns them off).
_TMA = {False: {"wide": set(range(1, 9)), "deep": set(range(1, 9)), "other": set(range(2, 9)),
                "shallow": set(range(2, 9))},
        True: {cls: set(range(1, 9)) for cls in ("wide", "deep", "other", "shallow")}}
# The copy offsets (MmaConfig.row_offsets) are in no table: they won 1.05-1.10x served at 49-64 rows without tensor
# copies (twenty-third session), where the rule now takes tensor copies, which replace the copies they change.
# Column tiles T at which the instance starts every mma from a constant (MmaConfig.const_start), which cuts
# instructions per stage but moves registers. Served beside tensor copies on an H100 and checked on an H200
# (twenty-fourth session): 1.02-1.09x on gate_up at 9-24 and 33-64 rows, on qkv / GDN-in at every row count, on
# o_proj / GDN-out at 2-32 and 49-64 rows and on down_proj at 17-24; without it the narrower layers lost
# 0.92-0.95x at 9-32 rows. It lost 0.75-0.82x where its registers cost a CTA per SM (down_proj at 33-40 and 49-64
# rows, o_proj's three-stage instance at 33-40). The twenty-seventh session's layouts kept each row count's flag as
# it was (measured so; the flag not re-swept on them).
_CONST_START = {False: {"wide": {2, 3, 5, 6, 7, 8}, "deep": {3}, "other": set(range(1, 9)),
                        "shallow": {1, 2, 3, 4, 7, 8}},
                True: {cls: set(range(1, 9)) for cls in ("wide", "deep", "other", "shallow")}}
# Column tiles T at which a class takes a fixed number of K slices in place of k_slices' power of two. down_proj at
# 41-64 rows: three slices (240 CTAs of 23 groups) ran 1.04-1.07x faster served than the eight (640 CTAs of 9 groups)
# the aim gives, on an H100 (twenty-fifth session, docs/benchmarks.md), and 1.05-1.08x on an H200 (twenty-sixth);
# two, four, five and six were slower than eight. At 33-40 rows the same instance and slices (see _DEEP).
_FIXED_SLICES = {False: {"deep": {5: 3, 6: 3, 7: 3, 8: 3}}, True: {}}
_TABLES = {False: {"deep": _DEEP, "wide": _WIDE, "shallow": _SHALLOW, "other": _QKV},
           True: {"deep": _RTX_DEEP, "wide": _RTX_WIDE, "shallow": _RTX_SHALLOW, "other": _RTX_OTHER}}
WIDE_N = 16384  # outputs from which a layer is "wide" (gate_up's 17408 per rank; the LM head)
DEEP_GROUPS = 64  # groups of 128 inputs from which a layer is "deep" (down_proj's 68 per rank)
SHALLOW_GROUPS = 32  # groups below which a layer is "shallow" (o_proj's and GDN-out's 24 per rank)


def layer_class(n: int, k: int) -> str:
    groups = k // GROUP
    return ("deep" if groups >= DEEP_GROUPS else "wide" if n >= WIDE_N else
            "shallow" if groups < SHALLOW_GROUPS else "other")


def default_config(m: int, n: int, k: int, gpu: Gpu = H200, tma: bool = True) -> MmaConfig | None:
    """The configuration for m rows through a layer of N outputs and K inputs on `gpu`; None where the kernel
    does not apply (K not an even number of groups, N not whole CTA tiles, m outside 1..MAX_ROWS).

    The layout from the table of the GPU's architecture and the layer's class (`layer_class`) and column tiles;
    K slices: the table's fixed count where it has one (_FIXED_SLICES), else the fewest (a power of two, with at
    least the table's groups each) that give the CTAs per SM aimed for on the GPU's SMs. `tma` False: the same
    instances with per-thread copies (BONSAI_MMA_TMA=0)."""
    if k % (2 * GROUP) or not 1 <= m <= MAX_ROWS:  # an even number of groups: scales copied 4 bytes at a time
        return None
    groups = k // GROUP
    cls, tiles = layer_class(n, k), -(-m // 8)
    warps, rtiles, stages, gps, wm, per_sm, min_groups, *ks = _TABLES[gpu.rtx50][cls][tiles]
    cfg = MmaConfig(warps=warps, rtiles=rtiles, split=1, residual=m <= RESIDUAL_MAX_M, stages=stages, gps=gps,
                    wm=wm, ks=ks[0] if ks else 1, flat=tiles in _FLAT[gpu.rtx50].get(cls, ()),
                    const_start=tiles in _CONST_START[gpu.rtx50].get(cls, ()),
                    tma=tma and tiles in _TMA[gpu.rtx50].get(cls, ()))
    if n % cfg.rows_per_cta():
        return None
    fixed = _FIXED_SLICES[gpu.rtx50].get(cls, {}).get(tiles)
    return replace(cfg, split=fixed or k_slices(n // cfg.rows_per_cta(), groups, per_sm, min_groups, gpu.sms))


def k_slices(row_tiles: int, groups: int, per_sm: float, min_groups: int, sms: int) -> int:
    """The fewest K slices (a power of two) that give `row_tiles` CTA row tiles at least `per_sm` CTAs per SM on
    `sms` SMs, as long as each slice keeps `min_groups` groups of 128 inputs."""
    split = 1
    while row_tiles * split < per_sm * sms and groups // (split * 2) >= min_groups:
        split *= 2
    return split


def template(rows: int, config: MmaConfig, out_dtype: torch.dtype) -> str:
    """The C++ name (NVRTC name expression) of the kernel instance that runs `rows` batch rows: its column tiles
    are config.tiles(rows), the one place that count is worked out. The template's trailing defaults (KS = 1 and
    the code-shape flags off) are left out, so an instance keeps the name, and the cache entry, it had before
    they existed."""
    args = [config.tiles(rows), config.rtiles, config.warps, config.wm, str(config.residual).lower(), _OUT[out_dtype],
            config.stages, config.gps]
    optional = [config.ks, *(str(f).lower() for f in (config.flat, config.row_offsets, config.const_start,
                                                        config.tma))]
    while optional and optional[-1] in (1, "false"):  # the template's defaults: KS = 1, the flags off
        optional.pop()
    maps = ["TensorMap"] * 3 if config.tma else []  # the kernel's by-value parameters: the three maps
    return f"ternary_mma<{', '.join(map(str, args + optional + maps))}>"


def compile_instance(name: str, capability: str) -> tuple[bytes, str]:
    """NVRTC: the instance `name` as a cubin for sm_<capability>, and its mangled name. Host only (no GPU
    needed, any thread; once per process): make compile-check calls it for sm_90 and sm_120."""
    return nvrtc.compile_file(SOURCE, name, capability)


@functools.cache
def _load(name: str, capability: str, device_index: int, shared: int):
    fn = nvrtc.load_file(SOURCE, name, capability, device_index)
    if shared > SHARED_DEFAULT:
        nvrtc.allow_shared(fn, shared, device_index)
    return fn


def kernel(rows: int, config: MmaConfig, out_dtype: torch.dtype, device: torch.device, shared_mem: int | None = None):
    """The loaded instance for `rows` batch rows on `device`'s GPU (compiled once per process), opted in to
    its shared memory (or to `shared_mem` bytes, for a padded launch)."""
    index = torch.device(device).index or 0
    major, minor = nvrtc.capability(index)
    shared = config.shared_bytes(config.tiles(rows)) if shared_mem is None else shared_mem
    return _load(template(rows, config, out_dtype), f"{major}{minor}", index, shared)


def _slices(groups: int, split: int) -> tuple[int, int]:
    """(groups per K slice, number of slices)."""
    per = -(-groups // split)
    return per, -(-groups // per)


def reserve(device: torch.device | str, n: int, k: int, config: MmaConfig, rows: int = MAX_ROWS) -> None:
    """Grow the shared split-K workspace (dp4a's: the layers run one after another on one stream) for this
    layer's calls of up to `rows` rows, at load time, so that no call (nor a CUDA-graph capture) allocates."""
    from bonsai_vllm.ternary.kernels.dp4a import shared_workspace

    _, splits = _slices(k // GROUP, config.split)
    shared_workspace(device).get(splits * rows * n if splits > 1 else 1, n // config.rows_per_cta())


def early_pays(grid: int, rows: int, k: int, sms: int, prep: str = PREP_DP4A, prep_rows: int = 1,
               ks: int = 1) -> bool:
    """Whether a grid of `grid` CTAs for `rows` batch rows of K = `k` inputs gains from starting while the prep
    ahead of it runs: `prep` the kernel that prepares its activations (Dp4aActivations.prep), `prep_rows` the rows
    each of its programs takes. Every prep runs one program per 1024 inputs of each row or row group, P in all,
    and releases the kernel once all of them have started; its CTAs then take what the prep leaves free on the
    SMs, and below one CTA per SM they can double up on some SMs while others idle. Fitted on the H200, the served
    call forced both ways and alternated at 3-64 rows (docs/benchmarks.md, eighteenth and nineteenth sessions;
    tests/core/test_mma.py keeps the points):
    - behind dp4a.prepare (x rotated, as vLLM hands down_proj its input): early from two CTAs per SM (1-6 %
      faster; 4-6 % slower at gate_up's 32 rows and down_proj's 20-24), or below that where the grid fits beside
      the prep's rows (o_proj / GDN-out's 80 CTAs 3-7 % faster to 48 rows, qkv's 112 to 20) unless the prep's
      programs run more than two per SM (down_proj's 80 CTAs at 40 rows: 1.34x slower early);
    - behind the CUDA C rotation + prep (rotate_prep.cu, one row per CTA: served on the other five layers) and
      behind the RMSNorm + rotation + prep (rotate_prep.norm_rotate_prep, a CTA per block of each row too), whose
      CTAs are done in about 2 µs (refitted in the twenty-first session on an H100 sweep of all five layers at
      3-64 rows, both preps; an H200 run of the same day agreed at the ten points it measured): early from 2.25
      CTAs per SM (the split-K grids at 3-8 rows, 3-12 % faster), where the grid and P fit in one wave side by
      side (o_proj / GDN-out to 16 rows, 9-11 %), or with four warps along K (`ks`, 17-32 rows: 5-9 %) while P is
      at most 1.3 per SM. Elsewhere early lost up to 1.68x (qkv / GDN-in at 20-24 rows, gate_up's 272 CTAs
      1.1-1.5x at 10-32 rows); the nineteenth session had measured it winning there on the H200 (gate_up at 12-64
      rows, qkv to 32), and the tree of today no longer does (docs/dev-notes.md, twenty-first session);
    - behind the Triton rotation + prep (hadamard.rotate_dp4a, where the CUDA C one is switched off), whose
      programs run longer: where the grid fits beside them (o_proj / GDN-out's 80 CTAs: 11-17 % faster), or from
      two CTAs per SM while they are few (5-11 %) or many (gate_up from 56 rows, one row per program: 1.5 %). In
      between, early lost up to 1.52x (gate_up at 16 rows, one row per program: 40.7 µs against 26.8), and from
      one CTA per SM down up to 1.8x.
    `ks`: the kernel's warps along K (MmaConfig.ks)."""
    programs = -(-rows // max(prep_rows, 1)) * -(-k // 1024)  # P: the prep's programs
    if prep in (PREP_CUDA_ROTATION, PREP_NORM_ROTATION):
        return 4 * grid >= 9 * sms or grid + programs <= sms or (ks >= 4 and 10 * programs <= 13 * sms)
    if prep == PREP_ROTATION:
        return grid + programs <= sms or (grid >= 2 * sms and (3 * programs <= sms or programs >= 2 * sms))
    return grid >= 2 * sms or (grid + rows <= sms and programs <= 2 * sms)


def gemm(act: Dp4aActivations, packed: torch.Tensor, scales: torch.Tensor, config: MmaConfig, workspace,
         out: torch.Tensor | None = None, early: bool | None = None, shared_mem: int | None = None) -> torch.Tensor:
    """y [M, N] (float32 unless `out` says otherwise) = the ternary layer (packed int32 [N, K/16], scales fp16
    [N, K/128]) applied to the M rows of `act` (1 <= M <= 64); `out` may be any [M, N] view with unit stride
    along N. `workspace`: dp4a.Dp4aWorkspace (partials and per-tile counters, zero between calls). `early`:
    launched as a programmatic dependent of the kernel ahead of it (nvrtc.launch; sm_90 and later; None:
    EARLY_LAUNCH where `early_pays` says so of the kernel that prepared `act`). `shared_mem`: launch with that
    many bytes of shared memory instead of the stages' own (at least those; benchmarks/mma_gemm.py pads CTAs so that the H200
    holds as many per SM as the RTX card would)."""
    n, kw = packed.shape
    m = act.rows
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"mma.gemm: {m} rows; the kernel takes 1 to {MAX_ROWS}")
    tiles = config.tiles(m)
    if kw % 16 or n % config.rows_per_cta() or not config.fits(tiles):
        raise ValueError(f"mma.gemm: N = {n}, K = {kw * 16} do not fit {config} (N a multiple of "
                         f"{config.rows_per_cta()}, K of {2 * GROUP}; {tiles} column tiles a multiple of wm, "
                         f"shared memory within {SHARED_MAX} bytes)")
    y = torch.empty(m, n, dtype=torch.float32, device=packed.device) if out is None else out.view(m, n)
    if y.stride(1) != 1:
        raise ValueError("mma.gemm: out needs unit stride along N")
    per, splits = _slices(kw // 8, config.split)
    ctas = n // config.rows_per_cta()
    partials, counters = workspace.get(splits * m * n if splits > 1 else 1, ctas)
    need = config.shared_bytes(tiles)
    if shared_mem is not None and shared_mem < need:
        raise ValueError(f"mma.gemm: shared_mem = {shared_mem} bytes; {config} at {m} rows needs {need}")
    shared = need if shared_mem is None else shared_mem
    fn = kernel(m, config, y.dtype, packed.device, shared)
    # early: the kernel may start while the activation prep ahead of it runs (it copies its first stages'
    # weights, then waits for the prep's stores); the prep lets it (triton_runtime.launch_dependents)
    index = packed.device.index or 0
    if early is None:
        early = EARLY_LAUNCH and early_pays(ctas * splits, m, kw * 16, nvrtc.sm_count(index), act.prep, act.prep_rows,
                                            config.ks)
    early = early and nvrtc.capability(index)[0] >= 9
    args = [packed, scales, act.xa, act.xr, act.gx, act.gr, act.s, y, partials, counters, m, n, kw, per, y.stride(0)]
    if config.tma:
        args += tensor_maps(act, packed, config, tiles)
    nvrtc.launch(fn, (ctas, splits, 1), (config.threads(), 1, 1), args, shared_mem=shared, early=early)
    return y


def tensor_maps(act: Dp4aActivations, packed: torch.Tensor, config: MmaConfig, tiles: int) -> list[bytes]:
    """The tensor-copy route's three maps (mma.cu's TMA): the codes [N rows][KW words] in boxes of the CTA's rows ×
    a stage's words, x8 and r8 [4 M rows (batch row, lane)][KW words] in boxes of the column tiles' 32 · tiles
    rows (past 4 M: zeros) × a stage's words."""
    words = 8 * config.gps
    kw = packed.shape[1]
    return [nvrtc.tensor_map(packed, (words, config.rows_per_cta())),
            *(nvrtc.tensor_map(t.view(-1, kw), (words, 32 * tiles)) for t in (act.xa, act.xr))]


def gemm_reference(act: Dp4aActivations, packed: torch.Tensor, scales: torch.Tensor,
                   residual: bool = True) -> torch.Tensor:
    """The kernel's maths in torch: y float32 [M, N]; without `residual`, x8 alone (the r8 term dropped).

    Per group the integer sums Σ u·x8 are exact in float32 (|sum| <= 2 · 127 · 128 < 2^24), so one batched
    float32 matmul per group computes them on any device; only the float32 scaling differs from the kernel's
    order (relative ~1e-7)."""
    n, kw = packed.shape
    m, groups = act.rows, kw // 8
    shifts = torch.arange(16, device=packed.device, dtype=torch.int32) * 2
    u = ((packed.unsqueeze(-1) >> shifts) & 3).to(torch.float32).view(n, groups, GROUP)  # [N, G, 128]

    def group_sums(planar: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:  # -> [G, M, N]
        x8 = unplanar(planar).to(torch.float32).view(m, groups, GROUP).transpose(0, 1)  # [G, M, 128]
        return torch.bmm(x8, u.permute(1, 2, 0)) - sums.t().to(torch.float32)[:, :, None]

    v = act.s[:, 0].t()[:, :, None] * group_sums(act.xa, act.gx)  # [G, M, N]
    if residual:
        v = v + act.s[:, 1].t()[:, :, None] * group_sums(act.xr, act.gr)
    return (scales.t().to(torch.float32)[:, None, :] * v).sum(0)
