"""The signed block Hadamard rotation of decode rows and their dp4a prep in CUDA C, one launch (issue 19):
`rotate_prep.cu`. It gives what hadamard.rotate_dp4a (Triton) gives, the activations of the kernels after it
(stream_gemv, mma, the dp4a GEMV), with the butterflies in registers and warp shuffles instead of tensor-core
products and layout conversions (the file's first comment has the layout).

Compiled at run time by NVRTC like mma.cu (no nvcc in the image; `make compile-check` compiles it for sm_90 and
sm_120 on a machine without a GPU). It lets the kernel after it start early (`griddepcontrol`), so it runs on
sm_90 and later only (`applies`).

    act = rotate_prep(x, signs, block)      # x [M, K] bf16 / fp16 / fp32 on the GPU; Dp4aActivations of M rows

The judge is `rotate_prep_reference`: the kernel's butterflies in the kernel's order in float32 torch, then
dp4a.prepare_reference; the kernel must give its bytes, sums and scales bit for bit. Behind it,
reference.signed_block_hadamard (the rotation as a product with H) differs from the butterflies by float32
rounding only.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import torch

from bonsai_vllm import nvrtc
from bonsai_vllm.ternary.kernels.dp4a import (PREP_CUDA_ROTATION, Dp4aActivations, empty_activations, made_by,
                                              prepare_reference)

SOURCE = Path(__file__).with_name("rotate_prep.cu")
_IN = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BLOCKS = (256, 512, 1024)  # rotation blocks the kernel takes (BLOCK / 8 threads per row: whole warps)
ROWS_PER_CTA = (1, 2, 4)  # R: rows of one block per CTA (R · BLOCK / 8 threads)
# One row per CTA at every row count. On the H200 (docs/benchmarks.md, nineteenth session) alone 2.2 µs against 2.5
# for two rows per CTA and 3.4 for four at 1-24 rows (two rows level from 32 rows, where one row per CTA needs more
# than a wave); served, one row per CTA was within 3 % of the fastest of the three behind every layer at 1-64 rows,
# with the launch rule of mma.early_pays, and two rows per CTA up to 1.4x slower where the mma kernel started early.
ROWS_DEFAULT = 1


def template(block: int, rows_per_cta: int, in_dtype: torch.dtype) -> str:
    """The C++ name (NVRTC name expression) of the instance for `block`, R rows per CTA and x of `in_dtype`."""
    return f"rotate_prep<{block}, {rows_per_cta}, {_IN[in_dtype]}>"


def compile_instance(name: str, capability: str) -> tuple[bytes, str]:
    """NVRTC: the instance `name` as a cubin for sm_<capability>, and its mangled name (host only; once per
    process)."""
    return nvrtc.compile_file(SOURCE, name, capability)


def kernel(block: int, rows_per_cta: int, in_dtype: torch.dtype, device: torch.device | str):
    """The loaded instance on `device`'s GPU (compiled once per process): call it at load time, outside a CUDA
    graph capture."""
    index = torch.device(device).index or 0
    major, minor = nvrtc.capability(index)
    return nvrtc.load_file(SOURCE, template(block, rows_per_cta, in_dtype), f"{major}{minor}", index)


def applies(device: torch.device | str, block: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the kernel runs rows of `dtype` rotated per `block` on `device`: CUDA, sm_90 or later (the early
    launch's PTX), a block it takes."""
    device = torch.device(device)
    return (device.type == "cuda" and block in BLOCKS and dtype in _IN
            and nvrtc.capability(device.index or 0)[0] >= 9)


def _norm_bits(block: int) -> int:
    """The float32 bits of 1 / sqrt(block) (what hadamard's kernels multiply by), as the int the launch takes."""
    return struct.unpack("<i", struct.pack("<f", 1.0 / math.sqrt(block)))[0]


def rotate_prep(x: torch.Tensor, signs: torch.Tensor, block: int = 1024, *, out: Dp4aActivations | None = None,
                rows_per_cta: int | None = None) -> Dp4aActivations:
    """Rows x [K] or [M, K] -> dp4a.Dp4aActivations of H(s ⊙ x) per `block`, one launch. `signs` float32 [K]
    (±1); `rows_per_cta`: R (None: ROWS_DEFAULT)."""
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    if block not in BLOCKS or k % block:
        raise ValueError(f"rotate_prep: K = {k} is not whole blocks of {block} (blocks {BLOCKS})")
    if x2.dtype not in _IN:
        raise ValueError(f"rotate_prep: x of {x2.dtype}; the kernel reads {sorted(map(str, _IN))}")
    if signs.shape != (k,) or signs.dtype != torch.float32 or not signs.is_contiguous():
        raise ValueError(f"rotate_prep: signs must be contiguous float32 [{k}], got {signs.dtype} {list(signs.shape)}")
    if x2.stride(-1) != 1 or x2.data_ptr() % 16 or (x2.stride(0) * x2.element_size()) % 16:
        x2 = x2.contiguous()  # the kernel loads eight inputs at a time, 16-byte aligned
    rows = ROWS_DEFAULT if rows_per_cta is None else rows_per_cta
    if rows not in ROWS_PER_CTA:
        raise ValueError(f"rotate_prep: {rows} rows per CTA; the kernel takes {ROWS_PER_CTA}")
    act = empty_activations(k, x.device, m) if out is None else out
    fn = kernel(block, rows, x2.dtype, x.device)
    fn(grid=(k // block, -(-m // rows), 1), block=(rows * block // 8, 1, 1),
       args=[x2, signs, act.xa, act.xr, act.gx, act.gr, act.s, m, k, x2.stride(0), _norm_bits(block)])
    return made_by(act, PREP_CUDA_ROTATION, rows)


def butterflies_reference(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """H(s ⊙ x) / sqrt(block) per block of x [M, K], float32, by the kernel's butterflies in the kernel's order
    (index bit 0 first; each step a + b on the lower index, a − b on the upper), so with its rounding."""
    m, k = x.shape
    v = (x.float() * signs.float()).reshape(m, k // block, block)
    bit = 1
    while bit < block:
        pairs = v.reshape(m, k // block, block // (2 * bit), 2, bit)
        a, b = pairs[:, :, :, 0], pairs[:, :, :, 1]
        v = torch.stack((a + b, a - b), dim=3).reshape(m, k // block, block)
        bit *= 2
    norm = torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32)
    return (v * norm).reshape(m, k)


def rotate_prep_reference(x: torch.Tensor, signs: torch.Tensor, block: int = 1024) -> Dp4aActivations:
    """What `rotate_prep` must give, bit for bit: dp4a.prepare_reference of the butterflies' rotation."""
    return prepare_reference(butterflies_reference(x.reshape(-1, x.shape[-1]), signs, block))
