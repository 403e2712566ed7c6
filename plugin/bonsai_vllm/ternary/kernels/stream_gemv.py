"""The ternary layer for one, two or four batch rows in CUDA C, codes streamed past activations held in registers
(issue 19): `stream_gemv.cu`. Two rows are one user's decode step with MTP on (the token and its draft); four
rows (two users with MTP) only where `_RULES` measured a gain.

Why another one-row kernel: the Triton dp4a GEMV (dp4a.py) issues about as few instructions per weight but runs
two warps per program at 128 registers, with K slices whose partials meet in a second pass; on the H200 it moved
31-45 % of copy bandwidth. Here each thread keeps its words' activation bytes in registers for the whole call,
each CTA takes a contiguous range of rows in one wave, and nothing is summed across CTAs (the file's first
comment has the layout). Compiled at run time by NVRTC like mma.cu: no nvcc in the image, and `make
compile-check` compiles it for sm_90 and sm_120 on a machine without a GPU.

    act = dp4a.prepare(xr)                  # or rotate_prep.rotate_prep(x, signs): the same prep as dp4a and mma
    y = gemv(act, packed, scales, config, out=y)

The judge is dp4a.gemv_reference (the same integer maths), and behind it the float32 layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from bonsai_vllm import nvrtc
from bonsai_vllm.ternary.kernels.dp4a import GROUP, Dp4aActivations

SOURCE = Path(__file__).with_name("stream_gemv.cu")
_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_ROWS = 4  # batch rows one launch takes (1, 2 or 4: the per-thread partials fold by halves)
SHARED_MAX = 48 * 1024  # dynamic shared memory without opting in (sm_90 and sm_120 alike)
# Launch as a programmatic dependent of the prep kernel by default (benchmarks/stream_gemv.py measures it
# against an ordinary launch).
EARLY_LAUNCH = True


@dataclass(frozen=True)
class StreamConfig:
    """How one layer's call is cut up (stream_gemv.cu's template and grid)."""

    words: int  # C: code words per thread (1, 2 or 4); the CTA has ceil(K/16 / (32·C)) warps
    rows: int  # R: output rows per tile (a power of two up to 32)
    prefetch: bool  # load the next tile's codes before this tile's dp4a run
    ctas_per_sm: int  # the grid: this many CTAs per SM, one wave, each a contiguous range of rows

    def __str__(self) -> str:
        return f"C={self.words} R={self.rows} pf={int(self.prefetch)} ctas/SM={self.ctas_per_sm}"

    def warps(self, k: int) -> int:
        return -(-(k // 16) // (32 * self.words))


# Per batch rows and layer class: (words per thread, output rows per tile, prefetch, CTAs per SM). From the H200
# sweep of benchmarks/stream_gemv.py (96 configurations per shape, docs/benchmarks.md), each the class's fastest
# (its other layer within 1 %): two words per thread everywhere; prefetching the next tile gained nothing there
# beyond noise (it costs 30 registers). The LM head (N > 65536; a sweep of 12) at 80 % of copy bandwidth at one
# row, and 72 µs at two (the mma kernel: 81).
_RULES = {1: {"wide": (2, 4, False, 6), "deep": (2, 4, False, 4), "narrow": (2, 8, False, 6), "other": (2, 8, False, 4),
              "head": (2, 8, False, 4)},
          2: {"wide": (2, 4, False, 4), "deep": (2, 4, False, 2), "narrow": (2, 4, False, 4), "other": (2, 4, False, 4),
              "head": (2, 8, False, 4)},
          # four rows: only the narrow layers (the GEMV alone 6.9 µs against the mma route's 10.1 served); on the
          # others the GEMV alone was already level with or slower than the mma route with its prep
          4: {"narrow": (2, 4, False, 6)}}
WIDE_N = 16384  # gate_up's 17408 outputs per rank
HEAD_N = 65536  # the LM head's 124160
DEEP_K = 6144  # down_proj's 8704 inputs per rank
NARROW_K = 4096  # o_proj's and GDN-out's 3072


def layer_class(n: int, k: int) -> str:
    return ("head" if n > HEAD_N else "wide" if n >= WIDE_N else "deep" if k > DEEP_K else "narrow" if k <= NARROW_K
            else "other")


def default_config(n: int, k: int, m: int = 1) -> StreamConfig | None:
    """The configuration for m batch rows through a layer of N outputs and K inputs (`_RULES`); None where the
    kernel does not apply (K not whole groups of 128, more than 32 warps' worth of
    words, a row count without a rule)."""
    rule = _RULES.get(m, {}).get(layer_class(n, k))
    if k % GROUP or n < 1 or rule is None:
        return None
    config = StreamConfig(*rule)
    return config if config.warps(k) <= 32 else None


def template(config: StreamConfig, m: int, k: int, out_dtype: torch.dtype) -> str:
    """The C++ name (NVRTC name expression) of the instance for m batch rows, K inputs and y of `out_dtype`."""
    return (f"ternary_stream_gemv<{m}, {config.words}, {config.rows}, {k // 16}, "
            f"{str(config.prefetch).lower()}, {_OUT[out_dtype]}>")


def compile_instance(name: str, capability: str) -> tuple[bytes, str]:
    """NVRTC: the instance `name` as a cubin for sm_<capability>, and its mangled name (host only; once per
    process)."""
    return nvrtc.compile_file(SOURCE, name, capability)


def kernel(config: StreamConfig, m: int, k: int, out_dtype: torch.dtype, device: torch.device):
    """The loaded instance for m batch rows on `device`'s GPU (compiled once per process)."""
    index = torch.device(device).index or 0
    major, minor = nvrtc.capability(index)
    return nvrtc.load_file(SOURCE, template(config, m, k, out_dtype), f"{major}{minor}", index)


def launch_shape(config: StreamConfig, m: int, n: int, k: int, out_dtype: torch.dtype,
                 device: torch.device) -> tuple[object, int, int, int]:
    """(loaded kernel, CTAs, row capacity, warps) of a layer's calls; compiled and loaded on the first call."""
    return _launch_shape(config, m, n, k, out_dtype, torch.device(device).index or 0)


@functools.cache
def _launch_shape(config: StreamConfig, m: int, n: int, k: int, out_dtype: torch.dtype,
                  device_index: int) -> tuple[object, int, int, int]:
    # One wave of the CTAs an SM really holds of this instance on this GPU (its registers differ between sm_90
    # and sm_120): a second, partial wave would undo the row balance.
    fn = kernel(config, m, k, out_dtype, torch.device("cuda", device_index))
    warps = config.warps(k)
    sms = nvrtc.sm_count(device_index)
    _, cap = grid(config, n, k, sms, m)
    resident = nvrtc.resident_ctas(fn, 32 * warps, 4 * warps * m * cap)
    ctas, cap = grid(config, n, k, sms, m, resident)
    return fn, ctas, cap, warps


def grid(config: StreamConfig, n: int, k: int, sms: int, m: int = 1, resident: int | None = None) -> tuple[int, int]:
    """(CTAs, row capacity of a CTA's shared memory): one wave of ctas_per_sm per SM (or of the `resident` CTAs
    an SM holds of this instance, if fewer), at most one per row, and more if a CTA's warp sums (4 · warps · m ·
    capacity bytes) would not fit below SHARED_MAX."""
    ctas = min(n, sms * min(config.ctas_per_sm, resident or config.ctas_per_sm))
    warps = config.warps(k)
    while warps * m * -(-n // ctas) * 4 >= SHARED_MAX:
        ctas *= 2
    return ctas, -(-n // ctas)


def gemv(act: Dp4aActivations, packed: torch.Tensor, scales: torch.Tensor, config: StreamConfig,
         out: torch.Tensor | None = None, early: bool | None = None) -> torch.Tensor:
    """y [M, N] (float32 unless `out` says otherwise) = the ternary layer (packed int32 [N, K/16], scales fp16
    [N, K/128]) applied to the M rows of `act` (1 <= M <= MAX_ROWS); `out` may be any contiguous tensor of M·N
    elements. `early`: launched as a programmatic dependent of the kernel ahead of it (see nvrtc.launch; sm_90
    and later; None: EARLY_LAUNCH)."""
    n, kw = packed.shape
    m = act.rows
    if m not in (1, 2, 4):
        raise ValueError(f"stream_gemv.gemv: {m} rows; the kernel takes 1, 2 or 4")
    if kw % (GROUP // 16) or config.warps(kw * 16) > 32:
        raise ValueError(f"stream_gemv.gemv: K = {kw * 16} does not fit {config} (whole groups of {GROUP}, at "
                         "most 32 warps)")
    y = torch.empty(m, n, dtype=torch.float32, device=packed.device) if out is None else out
    if y.numel() != m * n or not y.is_contiguous():
        raise ValueError(f"stream_gemv.gemv: out needs {m} x {n} contiguous elements, got {list(y.shape)}")
    index = packed.device.index or 0
    fn, ctas, cap, warps = _launch_shape(config, m, n, kw * 16, y.dtype, index)
    early = (EARLY_LAUNCH if early is None else early) and nvrtc.capability(index)[0] >= 9
    # early: the kernel may start while the activation prep ahead of it runs (it streams its first codes, then
    # waits for the prep's stores); the prep lets it (triton_runtime.launch_dependents)
    nvrtc.launch(fn, (ctas, 1, 1), (32 * warps, 1, 1),
                 [packed, scales, act.xa, act.xr, act.gx, act.gr, act.s, y, n, cap], 4 * warps * m * cap, early=early)
    return y.view(m, n)
