"""The ternary layer for one batch row in CUDA C, codes streamed past activations held in registers (issue 19):
`stream_gemv.cu`.

Why another one-row kernel: the Triton dp4a GEMV (dp4a.py) issues about as few instructions per weight but runs
two warps per program at 128 registers, with K slices whose partials meet in a second pass; on the H200 it moved
31-45 % of copy bandwidth. Here each thread keeps its words' activation bytes in registers for the whole call,
each CTA takes a contiguous range of rows in one wave, and nothing is summed across CTAs (the file's first
comment has the layout). Compiled at run time by NVRTC like mma.cu: no nvcc in the image, and `make
compile-check` compiles it for sm_90 and sm_120 on a machine without a GPU.

    act = dp4a.prepare(xr)                  # or hadamard.rotate_dp4a(x, signs): the same prep as dp4a and mma
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
SHARED_MAX = 48 * 1024  # dynamic shared memory without opting in (sm_90 and sm_120 alike)


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


def default_config(n: int, k: int) -> StreamConfig | None:
    """The configuration for one row through a layer of N outputs and K inputs; None where the kernel does not
    apply (K not whole groups of 128, or more than 32 warps' worth of words)."""
    if k % GROUP or n < 1:
        return None
    config = StreamConfig(words=2, rows=8, prefetch=True, ctas_per_sm=4)
    return config if config.warps(k) <= 32 else None


def template(config: StreamConfig, k: int, out_dtype: torch.dtype) -> str:
    """The C++ name (NVRTC name expression) of the instance for K inputs and y of `out_dtype`."""
    return (f"ternary_stream_gemv<{config.words}, {config.rows}, {k // 16}, "
            f"{str(config.prefetch).lower()}, {_OUT[out_dtype]}>")


@functools.cache
def compile_instance(name: str, capability: str) -> tuple[bytes, str]:
    """NVRTC: the instance `name` as a cubin for sm_<capability>, and its mangled name (host only)."""
    return nvrtc.compile_cuda(SOURCE.read_text(), name, capability)


@functools.cache
def _load(name: str, capability: str, device_index: int):
    return nvrtc.load(*compile_instance(name, capability), device_index)


def kernel(config: StreamConfig, k: int, out_dtype: torch.dtype, device: torch.device):
    """The loaded instance on `device`'s GPU (compiled once per process)."""
    index = torch.device(device).index or 0
    major, minor = torch.cuda.get_device_capability(index)
    return _load(template(config, k, out_dtype), f"{major}{minor}", index)


@functools.cache
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def grid(config: StreamConfig, n: int, k: int, sms: int) -> tuple[int, int]:
    """(CTAs, row capacity of a CTA's shared memory): one wave of ctas_per_sm per SM, at most one per row, and
    more if a CTA's warp sums would not fit SHARED_MAX."""
    ctas = min(n, sms * config.ctas_per_sm)
    warps = config.warps(k)
    while warps * -(-n // ctas) * 4 >= SHARED_MAX:
        ctas *= 2
    return ctas, -(-n // ctas)


def gemv(act: Dp4aActivations, packed: torch.Tensor, scales: torch.Tensor, config: StreamConfig,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """y [1, N] (float32 unless `out` says otherwise) = the ternary layer (packed int32 [N, K/16], scales fp16
    [N, K/128]) applied to the one row of `act`; `out` may be any contiguous [1, N] or [N] tensor."""
    n, kw = packed.shape
    if act.rows != 1:
        raise ValueError(f"stream_gemv.gemv: {act.rows} rows; the kernel takes one")
    if kw % (GROUP // 16) or config.warps(kw * 16) > 32:
        raise ValueError(f"stream_gemv.gemv: K = {kw * 16} does not fit {config} (whole groups of {GROUP}, at "
                         "most 32 warps)")
    y = torch.empty(1, n, dtype=torch.float32, device=packed.device) if out is None else out
    if y.numel() != n or not y.is_contiguous():
        raise ValueError(f"stream_gemv.gemv: out needs {n} contiguous elements, got {list(y.shape)}")
    index = packed.device.index or 0
    ctas, cap = grid(config, n, kw * 16, _sms(index))
    warps = config.warps(kw * 16)
    fn = kernel(config, kw * 16, y.dtype, packed.device)
    fn(grid=(ctas, 1, 1), block=(32 * warps, 1, 1), shared_mem=4 * warps * cap,
       args=[packed, scales, act.xa, act.xr, act.gx, act.gr, act.s, y, n, cap])
    return y.view(1, n)
