"""The signed block Hadamard rotation of decode rows and their dp4a prep in CUDA C, one launch (issue 19):
`rotate_prep.cu`. It gives what hadamard.rotate_dp4a (Triton) gives, the activations of the kernels after it
(stream_gemv, mma, the dp4a GEMV), with the butterflies in registers and warp shuffles instead of tensor-core
products and layout conversions (the file's first comment has the layout).

Compiled at run time by NVRTC like mma.cu (no nvcc in the image; `make compile-check` compiles it for sm_90 and
sm_120 on a machine without a GPU). It lets the kernel after it start early (`griddepcontrol`), so it runs on
sm_90 and later only (`applies`).

    act = rotate_prep(x, signs, block)      # x [M, K] bf16 / fp16 / fp32 on the GPU; Dp4aActivations of M rows
    normed, residual, act = norm_rotate_prep(x, residual, w, eps, signs, block)  # the RMSNorm ahead, fused

The second kernel, `norm_rotate_prep`, first does what vLLM's fused_add_rms_norm does ahead of a layer (residual
add, RMSNorm) and then the rotation + prep of its output, so that a layer fed by a norm (qkv, GDN-in, gate_up)
needs one kernel ahead of its GEMV instead of two (issue 19: a kernel boundary cost ~1.1 µs on the H200). A CTA
per 1024-block of each row, as rotate_prep, each summing the squares of the whole row itself. Served with
BONSAI_FUSED_NORM (on by default; docs/dev-notes.md, twenty-first session).

The judge is `rotate_prep_reference`: the kernel's butterflies in the kernel's order in float32 torch, then
dp4a.prepare_reference; the kernel must give its bytes, sums and scales bit for bit. Behind it,
reference.signed_block_hadamard (the rotation as a product with H) differs from the butterflies by float32
rounding only. `norm_rotate_prep`'s judge is `norm_rotate_prep_reference`: the norm in the kernel's order of
additions, then `rotate_prep_reference` of the normed rows, all bit for bit.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import torch

from bonsai_vllm import nvrtc
from bonsai_vllm.ternary.kernels.dp4a import (PREP_CUDA_ROTATION, PREP_NORM_ROTATION, Dp4aActivations,
                                              empty_activations, made_by, prepare_reference)

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
    """NVRTC: the instance `name` (of either kernel: `template`, `norm_template`) as a cubin for sm_<capability>,
    and its mangled name (host only; once per process)."""
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


def _float_bits(value: float) -> int:
    """The bits of `value` as float32, as the int a launch takes."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _norm_bits(block: int) -> int:
    """The float32 bits of 1 / sqrt(block) (what hadamard's kernels multiply by), as the int the launch takes."""
    return _float_bits(1.0 / math.sqrt(block))


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """t [M, K] with unit stride along K and 16-byte aligned rows (the kernel's eight-input loads), copied if not."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
        return t.contiguous()
    return t


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
    x2 = _rows16(x2)
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


# ------------------------------------------------------------------------ the RMSNorm ahead of a layer, fused

NORM_MAX_K = 8192  # a row in one CTA of K / 8 threads (at most 1024)


def norm_template(block: int, k: int, in_dtype: torch.dtype, add: bool, prep: bool = True) -> str:
    """The C++ name of `norm_rotate_prep`'s instance for rows of K = `k` inputs rotated per `block`, of `in_dtype`,
    with (`add`) or without the residual add (vLLM's first layer has no residual yet), with (`prep`) or without the
    rotation + prep after the norm."""
    return f"norm_rotate_prep<{block}, {k // block}, {_IN[in_dtype]}, {int(add)}, {int(prep)}>"


def norm_applies(device: torch.device | str, k: int, block: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `norm_rotate_prep` takes rows of K = `k` of `dtype` rotated per `block` on `device`."""
    return applies(device, block, dtype) and k % block == 0 and k <= NORM_MAX_K


def norm_kernel(block: int, k: int, in_dtype: torch.dtype, add: bool, device: torch.device | str, prep: bool = True):
    """The loaded instance on `device`'s GPU (compiled once per process; call it at load, outside a capture)."""
    index = torch.device(device).index or 0
    major, minor = nvrtc.capability(index)
    return nvrtc.load_file(SOURCE, norm_template(block, k, in_dtype, add, prep), f"{major}{minor}", index)


def _check_norm_args(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, signs: torch.Tensor,
                     block: int) -> None:
    m, k = x.shape
    if block not in BLOCKS or k % block or k > NORM_MAX_K:
        raise ValueError(f"norm_rotate_prep: K = {k} is not whole blocks of {block} (blocks {BLOCKS}) up to "
                         f"{NORM_MAX_K}")
    if x.dtype not in _IN:
        raise ValueError(f"norm_rotate_prep: x of {x.dtype}; the kernel reads {sorted(map(str, _IN))}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"norm_rotate_prep: residual {residual.dtype} {list(residual.shape)} is not like x "
                         f"({x.dtype} {list(x.shape)})")
    if weight.shape != (k,) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"norm_rotate_prep: weight must be contiguous {x.dtype} [{k}] (x's dtype), got "
                         f"{weight.dtype} {list(weight.shape)}")
    if signs.shape != (k,) or signs.dtype != torch.float32 or not signs.is_contiguous():
        raise ValueError(f"norm_rotate_prep: signs must be contiguous float32 [{k}], got {signs.dtype} "
                         f"{list(signs.shape)}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of contiguous tensors a and b overlap."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def norm_rotate_prep(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     signs: torch.Tensor, block: int = 1024, *, weight_offset: float = 0.0, normed: bool = True,
                     prep: bool = True, residual_out: torch.Tensor | None = None, out: Dp4aActivations | None = None
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, Dp4aActivations | None]:
    """Rows x [M, K] (and `residual` [M, K] of x's dtype, or None) -> (normed [M, K] in x's dtype or None when
    `normed=False`, the new residual [M, K] or None without one, Dp4aActivations of H(s ⊙ normed) per `block`),
    one launch: z = x + residual, normed = z / sqrt(mean(z²) + eps) · (weight + weight_offset), weight [K] of x's
    dtype (the norm's parameter; weight_offset 1.0 for Qwen3.5's Gemma-style norm). With `prep=False`,
    `residual_out` may be `residual` itself (updated in place, as vLLM's fused_add_rms_norm does); with prep it must
    not overlap x or residual. `prep=False`: the add and norm alone
    (the normed rows always stored, no activations: None), for rows that the layer takes on another route."""
    x2 = x.reshape(-1, x.shape[-1])
    r2 = None if residual is None else residual.reshape(-1, residual.shape[-1])
    _check_norm_args(x2, r2, weight, signs, block)
    m, k = x2.shape
    x2 = _rows16(x2)
    if r2 is not None:
        r2 = _rows16(r2)
        if residual_out is None:
            residual_out = torch.empty_like(x2)
        elif (residual_out.shape != x2.shape or residual_out.dtype != x2.dtype or not residual_out.is_contiguous()
              or residual_out.data_ptr() % 16):
            raise ValueError("norm_rotate_prep: residual_out must be a contiguous 16-byte aligned tensor like x")
        elif prep and any(_overlap(residual_out, t) for t in (x2, r2)):
            # a CTA per block: another CTA of the row may still be reading what this one writes
            raise ValueError("norm_rotate_prep: with prep=True, residual_out must not overlap x or residual (the "
                             "row's CTAs each read the whole row); pass a separate tensor, or prep=False to update "
                             "the residual in place")
    if weight.data_ptr() % 16:
        weight = weight.clone()  # eight weights per load, 16-byte aligned
    y = torch.empty(m, k, dtype=x2.dtype, device=x2.device) if normed or not prep else None
    act = None if not prep else empty_activations(k, x.device, m) if out is None else out
    fn = norm_kernel(block, k, x2.dtype, r2 is not None, x.device, prep)
    # prep: a CTA per block of each row; else a CTA per row
    fn(grid=(k // block, m, 1) if prep else (m, 1, 1), block=(block // 8 if prep else k // 8, 1, 1),
       # pointers the instance never touches are passed as x (a launch argument is a tensor or an int)
       args=[x2, x2 if r2 is None else r2, x2 if r2 is None else residual_out, x2 if y is None else y,
             weight, signs, *([act.xa, act.xr, act.gx, act.gr, act.s] if act is not None else [x2] * 5),
             x2.stride(0), 0 if r2 is None else r2.stride(0), int(y is not None), _float_bits(weight_offset),
             _float_bits(eps), _norm_bits(block)])
    return y, residual_out, None if act is None else made_by(act, PREP_NORM_ROTATION, 1)


def norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, new residual) of rows x [M, K] as `norm_rotate_prep` computes them, bit for bit: float32, the sum of
    squares in the kernel's order (eight inputs per thread in turn, then shfl.xor 1 .. 16 inside each warp of 32
    threads, then the warps in turn), 1 / sqrt(mean + eps) rounded twice; results rounded to x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    z = x2.float() if residual is None else x2.float() + residual.reshape(m, k).float()
    parts = z.reshape(m, k // 8, 8)
    ss = torch.zeros(m, k // 8, dtype=torch.float32, device=z.device)
    for i in range(8):
        ss = ss + parts[:, :, i] * parts[:, :, i]
    lanes = ss.reshape(m, k // 256, 32)
    d = 1
    while d < 32:
        lanes = lanes + lanes[:, :, torch.arange(32, device=z.device) ^ d]
        d *= 2
    total = torch.zeros(m, dtype=torch.float32, device=z.device)
    for w in range(k // 256):
        total = total + lanes[:, w, 0]
    eps32 = torch.tensor(eps, dtype=torch.float32, device=z.device)
    rstd = 1.0 / torch.sqrt(total / torch.tensor(float(k), dtype=torch.float32, device=z.device) + eps32)
    factor = weight.float() + torch.tensor(weight_offset, dtype=torch.float32, device=z.device)
    normed = ((z * rstd[:, None]) * factor).to(x.dtype)
    return normed, None if residual is None else z.to(x.dtype)


def norm_rotate_prep_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                               signs: torch.Tensor, block: int = 1024, weight_offset: float = 0.0
                               ) -> tuple[torch.Tensor, torch.Tensor | None, Dp4aActivations]:
    """What `norm_rotate_prep` must give, bit for bit: `norm_reference`, then `rotate_prep_reference` of the normed
    rows (as rounded to x's dtype: the fused kernel prepares exactly what it stores)."""
    normed, res = norm_reference(x, residual, weight, eps, weight_offset)
    return normed, res, rotate_prep_reference(normed, signs, block)
