"""The ternary linear layer the vLLM adapter calls: weights prepared once at load, a path chosen per call.

    tw = prepare(packed, scales, signs)         # once, in process_weights_after_loading
    y  = ternary_linear(x, tw)                  # every forward: rotates x, then multiplies
    y  = ternary_linear(xr, tw, rotated=True)   # x already rotated (a TP=2 cut block: ternary.partition)
    y, residual = norm_ternary_linear(x, residual, norm_weight, eps, tw)  # the RMSNorm ahead of the layer too

Dispatch (by batch rows M = x.numel() / K and by device):
- no Triton for this tensor (CPU without TRITON_INTERPRET=1, or Triton missing): the reference maths,
  `ternary.reference` (the judge), so CPU serving keeps working;
- M <= `STREAM_MAX_M`, CUDA, BONSAI_STREAM_GEMV (on by default): the same prep as dp4a,
  then the CUDA C GEMV streaming the codes past activations held in registers (stream_gemv.cu; issue 19),
  launched to start while the prep runs: two launches;
- M <= `DP4A_MAX_M` (BONSAI_DP4A_GEMV, on by default; issue 19): the rotation kernel preparing x for dp4a
  (int8 bytes of x and of its residual: on CUDA from sm_90 the CUDA C rotate_prep.cu, BONSAI_CUDA_ROTATION,
  else Triton's hadamard.rotate_dp4a; dp4a.prepare when x comes rotated), then the dp4a GEMV (dp4a.py), which
  stores y in x's dtype: two launches;
- M <= `MMA_MAX_M` (BONSAI_MMA_GEMM, on by default; CUDA tensors only: the kernel is CUDA C compiled by
  NVRTC; W8 not kept): the same activation prep as dp4a, then the int8 tensor-core kernel decoding the codes
  in registers behind a cp.async pipeline (mma.cu; issue 19), configured per row count by the tables of the
  GPU's architecture (mma.default_config; BONSAI_MMA_RULE overrides): two launches;
- M <= `GEMV_MAX_M` (2; 64 when W8 is not kept): rotation kernel writing x' in the GEMV's layout (or a
  reorder kernel when x comes rotated) + decode GEMV from the 2-bit codes (gemv.py): two launches (three
  for gate_up at M = 1, whose split-K sums its partials in a second small launch);
- larger M: rotation, per-token int8 quantization, then the int8 matmul against W8 (expanded at load when
  `prepare(..., expand_int8=True)`, else per call into a scratch buffer) (int8mm.py): the Triton GEMM
  with the rescale fused, or cuBLAS `_int_mm` + a rescale pass, whichever int8mm.default_config names;
  W8 not kept, up to `CODES_MAX_M` rows and BONSAI_CODES_GEMM on (the default; issue 19): no expansion, the
  int8 GEMM decoding the codes into W8 in its K loop (int8mm.codes_gemm, tile int8mm.codes_default_config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bonsai_vllm import settings
from bonsai_vllm.triton_runtime import usable
from bonsai_vllm.ternary.reference import dequantize

if TYPE_CHECKING:  # the kernel modules are imported lazily (they define @triton.jit functions)
    from bonsai_vllm.ternary.kernels.dp4a import Dp4aConfig
    from bonsai_vllm.ternary.kernels.gemv import GemvConfig
    from bonsai_vllm.ternary.kernels.int8mm import Int8GemmConfig
    from bonsai_vllm.ternary.kernels.mma import MmaConfig
    from bonsai_vllm.ternary.kernels.stream_gemv import StreamConfig

GROUP_SIZE = 128
BLOCK = 1024

# Batch rows up to which the GEMV (codes read once, decoded in registers) runs instead of the int8 matmul;
# from the H200 runs of bench_kernels and bench_decode (docs/benchmarks.md). With W8 kept at load the int8
# matmul (BM = 16, quantization included) beat every GEMV variant at M = 4, 8, 16 on all six layers (e.g.
# o_proj M = 4: 10.9 µs against 14.6) and costs the same at any M <= 16 (one padded row tile), while the
# split-K GEMV at M = 2 was faster on the N = 5120 layers (o_proj 10.3); M = 3 was not measured and goes to
# int8 by that flatness. Without W8 it has to expand W8 per call (as many bytes written as the layer has
# weights), which only pays beyond 64 rows.
GEMV_MAX_M = 2
GEMV_MAX_M_NO_W8 = 64
# Batch rows up to which the dp4a GEMV runs (when the layer was prepared for it; dp4a.MAX_ROWS at most):
# one row; from two rows (one user's step with MTP on) the tensor-core kernel is faster (H200,
# benchmarks/mma_gemm.py, docs/benchmarks.md).
DP4A_MAX_M = 1
# Batch rows up to which the streaming GEMV (stream_gemv.py) may run when the layer was prepared for it: one
# user's step, with or without MTP, and four rows on the layers where its rule says so.
STREAM_MAX_M = 4
# Batch rows up to which the int8 tensor-core kernel (mma.py) runs on CUDA: on the H200 it beat the routes it
# replaced at 2-64 rows on every shape (dp4a at 2, `gemv dot` above 16: 1.1-2.4x; docs/benchmarks.md).
MMA_MAX_M = 64
# Batch rows up to which a layer prepared with `codes` (W8 not kept) runs the GEMM decoding the codes in its K
# loop. Against expanding W8 per call + the int8 GEMM, on the H200 (make bench-prefill, 2026-12-03): 1.4-2.4×
# faster at 128 rows, 1.2-1.9× at 256, level at 512 (0.89-1.17×), 0.82-0.94× at 1024. A program of the codes
# GEMM decodes its weight tile once per row tile, so the decode grows with M while one expansion does not.
# The scheduler's chunks (256 prefill tokens + the decode rows while others decode, 512 when idle) are all here.
CODES_MAX_M = 512
# CTAs of the CUDA C rotation + prep (rows · K / 1024) up to which it goes ahead of the streaming GEMV; Triton's
# rotation + prep above. Launched early, the GEMV's CTAs slow the CUDA C prep down beside them (qkv at two rows:
# 4.4-6.1 µs start to end, 2.2 alone) while Triton's holds its 3.1 µs. Served on an H100 and an H200 (twenty-second
# session, docs/benchmarks.md): Triton's 1.08-1.19x faster at 10-12 CTAs (the 5120-wide layers at two rows, the
# 3072-wide at four), the CUDA C prep 1.03-1.11x faster at 3-6 (one row; the 3072-wide at two).
STREAM_CUDA_PREP_MAX_CTAS = 8


def cuda_prep_serves(path: str, rows: int, k: int, block: int) -> bool:
    """Whether the CUDA C rotation + prep (rather than Triton's) goes ahead of route `path` for `rows` rows of
    K inputs rotated by `block` (on a layer whose CUDA C rotation is on)."""
    return path != "stream" or rows * (k // block) <= STREAM_CUDA_PREP_MAX_CTAS


@dataclass
class TernaryWeights:
    """One ternary layer's tensors, on the layer's device; built by `prepare`, read-only afterwards."""

    packed: torch.Tensor  # int32 [N, K/16], code i of a word at bits 2i, value = code - 1
    scales: torch.Tensor  # fp16 [N, K/128]
    signs: torch.Tensor | None  # float32 [K]: this rank's slice of s (None: callers always pass rotated x)
    q: torch.Tensor  # int8 [N, K/128]: group scale as a multiple of row_scale (int8 path)
    row_scale: torch.Tensor  # float32 [N] = max_g |s[n, g]| / 127
    w_int8: torch.Tensor | None = None  # int8 [N, K] = code · q, when expanded at load
    block: int = BLOCK
    # the dp4a GEMV's config for 1, 2, ... rows (prepare's switch; DP4A_MAX_M of them): M <= len(dp4a) rows
    # take the dp4a route; None: never
    dp4a: tuple[Dp4aConfig, ...] | None = None
    # the mma kernel's config for 1, 2, ... rows (MMA_MAX_M of them; the route takes it from DP4A_MAX_M + 1
    # rows): prepared on CUDA when BONSAI_MMA_GEMM is on and the shape allows; None: never
    mma: tuple[MmaConfig, ...] | None = None
    # the streaming GEMV's config for 1, 2, ... rows (prepare's switch; CUDA only; STREAM_MAX_M of them, None
    # where its rule gives the row count to another route); None: never
    stream: tuple[StreamConfig, ...] | None = None
    # W8 not kept: the int8 route's rows through int8mm.codes_gemm (W8 made in its K loop) rather than
    # expand_int8 + GEMM (prepare's switch; None: BONSAI_CODES_GEMM). No effect when W8 is kept.
    codes: bool = False
    # unrotated decode rows (the dp4a, stream and mma routes) rotated and prepared by the CUDA C kernel
    # (rotate_prep.cu) rather than Triton's hadamard.rotate_dp4a (prepare's switch; CUDA, sm_90 and later), except
    # ahead of the streaming GEMV past STREAM_CUDA_PREP_MAX_CTAS (cuda_prep_serves)
    cuda_rotation: bool = False
    # `norm_ternary_linear` through rotate_prep.norm_rotate_prep: decode rows' residual add, RMSNorm, rotation and
    # prep in one CUDA C kernel, other rows' add and norm (prepare's switch; needs cuda_rotation and K whole
    # blocks up to rotate_prep.NORM_MAX_K); False: the norm in torch, then the layer
    fused_norm: bool = False

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 16

    def int8_bytes(self) -> int:
        """Extra device memory that `prepare(..., expand_int8=True)` takes for this layer."""
        return self.out_features * self.in_features


def prepare(packed: torch.Tensor, scales: torch.Tensor, signs: torch.Tensor | None = None, *,
            block: int = BLOCK, expand_int8: bool = False, dp4a: bool | None = None,
            mma: bool | None = None, stream: bool | None = None, codes: bool | None = None,
            cuda_rotation: bool | None = None, fused_norm: bool | None = None) -> TernaryWeights:
    """Build the layer state once at load time (same device as `packed`).

    `expand_int8=True` keeps W8 = code · q (1 byte per weight) for the prefill matmul; leave it False where
    memory is short (2 × 12 GB cards: the 27B's W8 would be 13.5 GB per rank) and W8 is expanded per call.
    `dp4a`: one-token rows through the dp4a GEMV where Triton runs and the shape allows (None: the
    BONSAI_DP4A_GEMV switch); its shared workspace is reserved here, not during a call. `mma`: 2 to MMA_MAX_M
    rows through the int8 tensor-core kernel on CUDA (None: BONSAI_MMA_GEMM); its instances are compiled here.
    `stream`: 1 to STREAM_MAX_M rows through the streaming CUDA C GEMV (None: BONSAI_STREAM_GEMV); compiled here.
    `codes`: without W8, the int8 route's rows through the GEMM that decodes the codes itself instead of
    expanding W8 per call (None: BONSAI_CODES_GEMM). `cuda_rotation`: unrotated decode rows rotated and
    prepared by the CUDA C kernel where it applies (None: BONSAI_CUDA_ROTATION); compiled here. `fused_norm`: with
    cuda_rotation, `norm_ternary_linear`'s decode rows through the kernel that also runs the RMSNorm ahead (None:
    BONSAI_FUSED_NORM); compiled here.
    """
    n, kw = packed.shape
    k = kw * 16
    if packed.dtype != torch.int32 or scales.shape != (n, k // GROUP_SIZE) or scales.dtype != torch.float16:
        raise ValueError(f"prepare: expected packed int32 [N, K/16] and scales fp16 [N, K/128], got "
                         f"{packed.dtype} {list(packed.shape)} and {scales.dtype} {list(scales.shape)}")
    if signs is not None and signs.shape != (k,):
        raise ValueError(f"prepare: signs shape {list(signs.shape)} != [{k}]")
    from bonsai_vllm.ternary.kernels.int8mm import int8_scales

    q, row_scale = int8_scales(scales)
    tw = TernaryWeights(packed.contiguous(), scales.contiguous(),
                        None if signs is None else signs.to(packed.device, torch.float32).contiguous(),
                        q, row_scale, None, block)
    if expand_int8:
        tw.w_int8 = _expand(tw)
    if dp4a is None:
        dp4a = settings.get("BONSAI_DP4A_GEMV")
    if dp4a and usable(packed):
        from bonsai_vllm.ternary.kernels import dp4a as dp4a_kernels

        configs = tuple(dp4a_kernels.default_config(n, k, rows) for rows in range(1, DP4A_MAX_M + 1))
        if None not in configs:  # the kernel applies to this shape
            tw.dp4a = configs
            for rows, config in enumerate(configs, 1):
                dp4a_kernels.reserve(packed.device, n, config, kw, rows)
    if mma is None:
        mma = settings.get("BONSAI_MMA_GEMM")
    if mma and packed.is_cuda:
        from bonsai_vllm.ternary.kernels import mma as mma_kernels

        gpu = mma_kernels.Gpu.of(packed.device, settings.get("BONSAI_MMA_RULE"))  # the rule's tables and SMs
        tma = settings.get("BONSAI_MMA_TMA")  # tensor copies where the rule takes them
        configs = tuple(mma_kernels.default_config(rows, n, k, gpu, tma) for rows in range(1, MMA_MAX_M + 1))
        if None not in configs:
            tw.mma = configs
            for rows in range(DP4A_MAX_M + 1, MMA_MAX_M + 1):  # compiled and loaded now, not inside a capture
                mma_kernels.reserve(packed.device, n, k, configs[rows - 1], rows)
                mma_kernels.kernel(rows, configs[rows - 1], torch.bfloat16, packed.device)
    if stream is None:
        stream = settings.get("BONSAI_STREAM_GEMV")
    if stream and packed.is_cuda:
        from bonsai_vllm.ternary.kernels import stream_gemv

        configs = tuple(stream_gemv.default_config(n, k, rows) for rows in range(1, STREAM_MAX_M + 1))
        for rows, config in enumerate(configs, 1):
            if config is not None:  # compiled and loaded now, not in a capture
                stream_gemv.launch_shape(config, rows, n, k, torch.bfloat16, packed.device)
        tw.stream = configs if any(configs) else None
    if codes is None:
        codes = settings.get("BONSAI_CODES_GEMM")
    tw.codes = bool(codes)
    if cuda_rotation is None:
        cuda_rotation = settings.get("BONSAI_CUDA_ROTATION")
    if cuda_rotation and tw.signs is not None and k % block == 0 and (tw.dp4a or tw.mma or tw.stream):
        from bonsai_vllm.ternary.kernels import rotate_prep

        if rotate_prep.applies(packed.device, block):
            tw.cuda_rotation = True
            rotate_prep.kernel(block, rotate_prep.ROWS_DEFAULT, torch.bfloat16, packed.device)  # not in a capture
    if fused_norm is None:
        fused_norm = settings.get("BONSAI_FUSED_NORM")
    if fused_norm and tw.cuda_rotation:
        from bonsai_vllm.ternary.kernels import rotate_prep

        if rotate_prep.norm_applies(packed.device, k, block):
            tw.fused_norm = True
            for add in (True, False):  # not in a capture
                for prep in (True, False):
                    rotate_prep.norm_kernel(block, k, torch.bfloat16, add, packed.device, prep)
    return tw


def _expand(tw: TernaryWeights) -> torch.Tensor:
    if usable(tw.packed):
        from bonsai_vllm.ternary.kernels.int8mm import expand_int8

        return expand_int8(tw.packed, tw.q)
    from bonsai_vllm.ternary.format import unpack_ternary

    return (unpack_ternary(tw.packed).to(torch.int16) * tw.q.to(torch.int16).repeat_interleave(GROUP_SIZE, -1)
            ).to(torch.int8)


def _reference(x: torch.Tensor, tw: TernaryWeights, rotated: bool, bias: torch.Tensor | None) -> torch.Tensor:
    from bonsai_vllm.ternary.reference import signed_block_hadamard

    xr = x.float() if rotated else signed_block_hadamard(x.float(), tw.signs, tw.block)
    y = xr @ dequantize(tw.packed, tw.scales, GROUP_SIZE).to(x.device).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@dataclass(frozen=True)
class Route:
    """What `ternary_linear` runs for a batch: "reference" (no Triton for this tensor), "stream" (config: the
    layer's stream_gemv.StreamConfig for that many rows), "dp4a" (config: the
    dp4a.Dp4aConfig the layer was prepared with for that many rows), "mma" (config: the layer's
    mma.MmaConfig for that many rows), "gemv" (config: the
    gemv.GemvConfig of gemv.default_config) or "int8" (config: the int8mm.Int8GemmConfig of
    int8mm.default_config; w8: "kept" at load or "expanded" per call; or, W8 not kept with tw.codes, backend
    "codes" of int8mm.codes_default_config and w8 "decoded in the kernel"). make gpu-check prints it beside
    each case, e.g. "int8 codes bm=128 bn=128 bk=64 group_m=8 warps=8 stages=3, W8 decoded in the kernel"."""

    path: str
    config: GemvConfig | Int8GemmConfig | Dp4aConfig | MmaConfig | StreamConfig | None = None
    w8: str = ""

    def __str__(self) -> str:
        if self.path in ("gemv", "dp4a", "mma", "stream"):
            return f"{self.path} {self.config}"
        if self.path == "int8":
            return f"int8 {self.config}, W8 {self.w8}"
        return self.path


def route(m: int, tw: TernaryWeights, triton_ok: bool = True) -> Route:
    """The path for m rows (the dispatch rule of the module docstring)."""
    if not triton_ok:
        return Route("reference")
    if tw.stream is not None and m <= len(tw.stream) and tw.stream[m - 1] is not None:
        return Route("stream", tw.stream[m - 1])
    if tw.dp4a is not None and m <= len(tw.dp4a):
        return Route("dp4a", tw.dp4a[m - 1])
    # 2 to MMA_MAX_M rows (one row stays on the GEMV even with dp4a off); with W8 kept its int8 GEMM stays
    if tw.mma is not None and DP4A_MAX_M < m <= len(tw.mma) and tw.w_int8 is None:
        return Route("mma", tw.mma[m - 1])
    if m <= (GEMV_MAX_M if tw.w_int8 is not None else GEMV_MAX_M_NO_W8):
        from bonsai_vllm.ternary.kernels import gemv

        return Route("gemv", gemv.default_config(m, tw.out_features, tw.in_features))
    from bonsai_vllm.ternary.kernels import int8mm

    if tw.w_int8 is None and tw.codes and m <= CODES_MAX_M:
        return Route("int8", int8mm.codes_default_config(m, tw.out_features, tw.in_features), "decoded in the kernel")
    return Route("int8", int8mm.default_config(m, tw.out_features, tw.in_features),
                 "kept" if tw.w_int8 is not None else "expanded")


def ternary_linear(x: torch.Tensor, tw: TernaryWeights, *, rotated: bool = False,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = H(s ⊙ x) · W'^T (+ bias), or xr · W'^T with `rotated=True`; returns x's dtype.

    Unrotated input needs K % block == 0 and `tw.signs`; a TP rank whose slice cuts a block rotates with
    ternary.partition.rotate_partition and passes rotated=True.
    """
    k = tw.in_features
    if x.shape[-1] != k:
        raise ValueError(f"ternary_linear: input width {x.shape[-1]} != layer input width {k}")
    if not rotated and (tw.signs is None or k % tw.block):
        raise ValueError(f"ternary_linear: cannot rotate here (width {k}, block {tw.block}, signs "
                         f"{'set' if tw.signs is not None else 'None'}); rotate with ternary.partition and "
                         "pass rotated=True")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    r = route(m, tw, usable(x))
    if r.path == "reference":
        return _reference(x, tw, rotated, bias)
    if r.path in ("dp4a", "mma", "stream"):
        from bonsai_vllm.ternary.kernels import dp4a
        from bonsai_vllm.ternary.kernels.hadamard import rotate_dp4a

        # rotation and prep in one kernel (or the prep alone when x comes rotated); the kernel stores y in
        # x's dtype itself unless a bias is added after it in float32
        if rotated:
            act = dp4a.prepare(x2)
        elif tw.cuda_rotation and cuda_prep_serves(r.path, m, k, tw.block):
            from bonsai_vllm.ternary.kernels.rotate_prep import rotate_prep

            act = rotate_prep(x2, tw.signs, tw.block)
        else:
            act = rotate_dp4a(x2, tw.signs, tw.block)
        y = _multiply_prepared(act, tw, r, x.dtype, bias)
    elif r.path == "gemv":
        from bonsai_vllm.ternary.kernels import gemv
        from bonsai_vllm.ternary.kernels.hadamard import block_hadamard, gemv_order

        cfg = r.config
        dt = gemv.x_dtype(cfg)
        # x' (the GEMV's planar layout): straight from the rotation kernel, or reordered if rotated already
        xp = gemv_order(x2, dtype=dt) if rotated else block_hadamard(x2, tw.signs, tw.block, gemv_order=True, dtype=dt)
        y = gemv.ternary_gemv(xp, tw.packed, tw.scales, bias, prepared=True, out_dtype=x.dtype, config=cfg)
    else:
        from bonsai_vllm.ternary.kernels import int8mm
        from bonsai_vllm.ternary.kernels.hadamard import block_hadamard, quantize_per_token

        # Rotate, then quantize: two passes, but each at full bandwidth (the fused kernel rotates twice).
        xr = x2 if rotated else block_hadamard(x2, tw.signs, tw.block)
        xq, ts = quantize_per_token(xr)
        if r.config.backend == "codes":  # W8 made from the codes inside the GEMM, never written
            y = int8mm.codes_gemm(xq, tw.packed, tw.q, ts, tw.row_scale, bias, x.dtype, config=r.config)
        else:
            w8 = tw.w_int8 if tw.w_int8 is not None else int8mm.expand_int8(tw.packed, tw.q)
            if r.config.backend == "int_mm" and x.is_cuda:
                y = int8mm.int_mm_linear(xq, w8, ts, tw.row_scale, bias, x.dtype)
            else:  # the Triton GEMM (an "int_mm" config's tile off CUDA)
                y = int8mm.int8_gemm(xq, w8, ts, tw.row_scale, bias, x.dtype, config=r.config)
    return y.view(*x.shape[:-1], tw.out_features)


def _multiply_prepared(act, tw: TernaryWeights, r: Route, dtype: torch.dtype,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] in `dtype` = the layer applied to prepared rows (dp4a.Dp4aActivations) by the kernel of route `r`
    ("stream", "dp4a" or "mma"); the kernel stores y in `dtype` itself unless a bias is added after it in float32."""
    from bonsai_vllm.ternary.kernels import dp4a

    device = act.xa.device
    y = torch.empty(act.rows, tw.out_features, dtype=dtype if bias is None else torch.float32, device=device)
    if r.path == "stream":
        from bonsai_vllm.ternary.kernels import stream_gemv

        stream_gemv.gemv(act, tw.packed, tw.scales, r.config, out=y)  # [M, N]
    elif r.path == "dp4a":
        dp4a.gemv(act, tw.packed, tw.scales, r.config, dp4a.shared_workspace(device), out=y)  # [M, N]
    else:
        from bonsai_vllm.ternary.kernels import mma

        mma.gemm(act, tw.packed, tw.scales, r.config, dp4a.shared_workspace(device), out=y)  # [M, N]
    return y if bias is None else (y + bias.float()).to(dtype)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM 0.32's RMSNorm ahead of a layer, in torch (vllm.ir.ops.layernorm's fused_add_rms_norm / rms_norm;
    weight_offset 1.0 for GemmaRMSNorm, Qwen3.5's): (normed, new residual) of x [..., K], in x's dtype, the sums
    in float32; without a residual the new residual is None."""
    z = x.float() if residual is None else x.float() + residual.float()
    normed = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + weight_offset)
    return normed.to(x.dtype), None if residual is None else z.to(x.dtype)


def norm_ternary_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        tw: TernaryWeights, *, weight_offset: float = 0.0
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y [..., N], new residual [..., K] or None) for an RMSNorm (x + residual, or x alone without one;
    `norm_weight` + `weight_offset`, `eps`) and then this layer on unrotated input: what vLLM's fused_add_rms_norm
    (rms_norm) followed by `ternary_linear` gives, where the normed rows feed nothing but this layer (gate_up_proj
    behind post_attention_layernorm, qkv_proj behind an attention layer's input_layernorm).

    Decode rows on the stream / dp4a / mma routes of a layer prepared with `fused_norm` take one CUDA C kernel for
    the add, norm, rotation and prep (rotate_prep.norm_rotate_prep; the normed rows are never stored) and then the
    layer's kernel; its other rows the same kernel's add and norm alone and then `ternary_linear`; a layer not
    prepared so (CPU, the switch off) the norm in torch (`rms_norm`) and `ternary_linear`.
    """
    k = tw.in_features
    if x.shape[-1] != k or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"norm_ternary_linear: x {list(x.shape)} and residual "
                         f"{None if residual is None else list(residual.shape)} must both be [..., {k}] (the "
                         "layer's input width)")
    x2 = x.reshape(-1, k)
    if tw.fused_norm and norm_weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype):
        from bonsai_vllm.ternary.kernels.rotate_prep import norm_rotate_prep

        r = route(x2.shape[0], tw, usable(x))
        prep = r.path in ("stream", "dp4a", "mma")
        r2 = None if residual is None else residual.reshape(-1, k)
        normed, new_residual, act = norm_rotate_prep(x2, r2, norm_weight, eps, tw.signs, tw.block,
                                                     weight_offset=weight_offset, normed=False, prep=prep)
        y = _multiply_prepared(act, tw, r, x.dtype) if prep else ternary_linear(normed, tw)
        return (y.view(*x.shape[:-1], tw.out_features),
                None if new_residual is None else new_residual.view(x.shape))
    normed, new_residual = rms_norm(x, residual, norm_weight, eps, weight_offset)
    return ternary_linear(normed, tw), new_residual
