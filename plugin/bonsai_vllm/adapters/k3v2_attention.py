"""vLLM 0.32 attention backend for `--kv-cache-dtype k3v2`: thin glue around kv/paged.py.

Selected through the patched platform lists (plugin/patches/0004, 0005) under the name BONSAI_K3V2,
which `register()` adds with vLLM's own hook (registry.register_backend). What it does per layer:

- `customize_spec`: pages of `paged.content_bytes` per token per KV head (200 B at head_dim 256: 168 B of
  packed K3V2 + the bf16 sinks/ring share), so vLLM's hybrid block-size alignment, pool sizing and
  allocation all see the real page. Layout LBHNC ([block, head, token, byte]): one (block, head) page is
  contiguous, as kv/kernels read it. Kernel block = the whole block (MultipleOf(128)): pages are
  never split, since each carries its own bf16 area.
- `do_kv_cache_update`: rotate K/V (per-layer randomized Hadamard, or the calibrated file named by
  BONSAI_KV_ROTATION, this rank's KV heads of it), write packed slots (Triton store on CUDA, reference on
  CPU) and the bf16 sink/ring slots.
- `forward`: decode rows and speculative verify rows (query_len <= 1 + num_speculative_tokens: the
  builder declares spec-as-decode, so vLLM orders them first) go through `PagedK3V2.decode` (the grouped
  decode kernel on CUDA, the reference on CPU), causal inside the row; prefill rows through
  `PagedK3V2.prefill_row` (on CUDA the same decode kernel over sub-rows of the row's queries; on CPU,
  or with BONSAI_K3V2_PREFILL_KERNEL=0, dequantized chunks in torch). Both follow one rule (see paged.py), so a
  verify row is never computed as a prefill that forgets the cached context.
- BONSAI_KV_CAPTURE=DIR: every layer also records the post-RoPE q/k/v of the first
  BONSAI_KV_CAPTURE_TOKENS tokens it sees (kv/calibration.py), for `bonsai-kv-calibrate`.

Not yet: CUDA graphs (the builder says NEVER: attention runs eagerly between piecewise graphs), a prefill
kernel of its own (the decode kernel reads the context once per sub-row of 2 queries).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from bonsai_vllm import settings
from bonsai_vllm.kv.calibration import SampleRecorder
from bonsai_vllm.kv.kernels.decode import auto_splits
from bonsai_vllm.kv.format import K3V2, KVFormat
from bonsai_vllm.kv.paged import PagedK3V2, content_bytes
from bonsai_vllm.kv.rotation import KVRotation

NAME = "BONSAI_K3V2"
SPEC_GUARD = 4  # oldest ring slots never trusted (paged.py): covers up to 4 speculative tokens
CACHE_DTYPE = "k3v2"
ROTATION_ENV = "BONSAI_KV_ROTATION"  # calibrated rotation file (bonsai-kv-calibrate); unset: data-free Hadamard
CAPTURE_ENV = "BONSAI_KV_CAPTURE"  # directory for calibration samples; unset: no capture
CAPTURE_TOKENS_ENV = "BONSAI_KV_CAPTURE_TOKENS"
# Prefill rows on CUDA through the decode kernel (sub-rows; paged.py), checked on the H200 by make gpu-check
# (4-6x faster than the torch route; docs/benchmarks.md). "0": the chunked torch path.
PREFILL_KERNEL_ENV = "BONSAI_K3V2_PREFILL_KERNEL"

logger = logging.getLogger("vllm.bonsai")  # under "vllm": vLLM's log handlers print it


def k3v2_format(head_size: int) -> KVFormat:
    return K3V2.with_(head_dim=head_size)


def _num_spec_tokens(vllm_config) -> int:
    spec = getattr(vllm_config, "speculative_config", None)
    return int(getattr(spec, "num_speculative_tokens", None) or 0) if spec is not None else 0


class K3V2AttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = [CACHE_DTYPE]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type["K3V2AttentionImpl"]:
        return K3V2AttentionImpl

    @staticmethod
    def get_builder_cls() -> type["K3V2MetadataBuilder"]:
        return K3V2MetadataBuilder

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        if spec.state_content_bytes is not None:
            return spec
        return replace(spec, state_content_bytes=content_bytes(k3v2_format(spec.head_size)))

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        # A multiple of 128 tokens: the decode kernel's fastest tile (BLOCK_N 128, bench_kv) must divide the
        # page. With MultipleOf(16) the 27B's hybrid-aligned block was 2080 tokens, which only BLOCK_N 32
        # divides (never benchmarked); 2176 costs 0.3% of the pool (capacity.vllm_pool).
        return [MultipleOf(128)]

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype == CACHE_DTYPE

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size >= 64 and head_size & (head_size - 1) == 0


@dataclass
class K3V2Metadata(AttentionMetadata):
    seq_lens: torch.Tensor  # [num_reqs] context incl. this step's tokens (device)
    seq_lens_cpu: torch.Tensor  # [num_reqs] (precise for prefill rows)
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    num_decodes: int  # decode + verify rows, first in the batch
    num_decode_tokens: int


class K3V2MetadataBuilder(AttentionMetadataBuilder[K3V2Metadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Verify rows (1 + num_speculative_tokens queries) are decode rows: vLLM orders them first.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> K3V2Metadata:
        cam = common_attn_metadata
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold)
        seq_cpu = cam.seq_lens_cpu_upper_bound
        if seq_cpu is None:
            seq_cpu = cam.seq_lens.cpu()
        return K3V2Metadata(seq_lens=cam.seq_lens[:cam.num_reqs], seq_lens_cpu=seq_cpu[:cam.num_reqs],
                            query_start_loc_cpu=cam.query_start_loc_cpu[:cam.num_reqs + 1],
                            block_table=cam.block_table_tensor[:cam.num_reqs], slot_mapping=cam.slot_mapping,
                            num_actual_tokens=cam.num_actual_tokens, num_decodes=num_decodes,
                            num_decode_tokens=num_decode_tokens)


_LAYER_IDX = re.compile(r"layers\.(\d+)\.")


def _layer_index(layer) -> int:
    m = _LAYER_IDX.search(getattr(layer, "layer_name", "") or "")
    return int(m.group(1)) if m else 0


def _tp_rank_size() -> tuple[int, int]:
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except AssertionError:  # no TP group (a backend built outside an engine, as the unit tests do)
        return 0, 1


@functools.lru_cache(maxsize=2)
def _rotation_tensors(path: str) -> dict[str, torch.Tensor]:
    """The calibrated file, read once per process (every layer's impl takes its entries from it)."""
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{ROTATION_ENV}={path}: no such file. Write it with bonsai-kv-calibrate "
                                f"(docs/kv-cache.md), or unset {ROTATION_ENV} for the data-free rotation.")
    tensors = load_file(path)
    logger.info("bonsai K3V2: calibrated KV rotations from %s (%d layers)", path, len(tensors) // 2)
    return tensors


@functools.lru_cache(maxsize=None)
def _file_rotation(path: str, layer: int, num_kv_heads: int, head_offset: int) -> KVRotation:
    """One layer's slice of the calibrated file, checked once per process (every layer's impl checks the
    whole model at start-up; the orthogonality check is a D×D product per head)."""
    return KVRotation.from_file(path, layer, num_kv_heads, head_offset, tensors=_rotation_tensors(path))


@functools.lru_cache(maxsize=1)
def _recorder() -> SampleRecorder | None:
    out = settings.get(CAPTURE_ENV)
    if out is None:
        return None
    rank, _ = _tp_rank_size()
    tokens = settings.get(CAPTURE_TOKENS_ENV)
    logger.info("bonsai K3V2: recording %d tokens of q/k/v per full-attention layer into %s", tokens, out)
    return SampleRecorder(out, rank, tokens)


def _full_attention_layers(vllm_config) -> list[int] | None:
    cfg = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    types = getattr(cfg, "layer_types", None)
    return [i for i, t in enumerate(types) if t == "full_attention"] if types else None


class K3V2AttentionImpl(AttentionImpl[K3V2Metadata]):
    supports_quant_query_input: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = CACHE_DTYPE,
                 logits_soft_cap=None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **kwargs):
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise NotImplementedError("K3V2: no ALiBi, sliding window or logit soft-cap")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("K3V2: decoder self-attention only")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.fmt = k3v2_format(head_size)
        # The same window with and without speculative decoding (up to SPEC_GUARD draft tokens), so MTP
        # on and off attend to the same exact/quantized positions: greedy output must not change.
        self.guard = max(SPEC_GUARD, _num_spec_tokens(get_current_vllm_config()))
        self._rot: dict[tuple[str, str], KVRotation] = {}
        self._geom: dict[int, PagedK3V2] = {}
        self.prefill_kernel = settings.get(PREFILL_KERNEL_ENV)
        # A calibrated file holds every KV head of the model; this rank takes its slice (vLLM gives rank r
        # heads [r·H/tp, ...), or replicates one head over several ranks when tp > H).
        rotation = settings.get(ROTATION_ENV)
        self.rotation_file = str(rotation) if rotation is not None else None
        rank, tp = _tp_rank_size()
        config = get_current_vllm_config()
        model_config = getattr(config, "model_config", None)
        total = model_config.get_total_num_kv_heads() if model_config is not None else self.num_kv_heads * tp
        self.head_offset = rank * total // tp
        if self.rotation_file:  # fail at start-up, naming the file, rather than at the first request
            for i in _full_attention_layers(config) or []:
                _file_rotation(self.rotation_file, i, self.num_kv_heads, self.head_offset)

    # ------------------------------------------------------------------------------------ helpers
    def rotation(self, layer, device: torch.device) -> KVRotation:
        name = getattr(layer, "layer_name", "") or ""
        key = (name, str(device))
        if key not in self._rot:
            i = _layer_index(layer)
            if self.rotation_file:
                r = _file_rotation(self.rotation_file, i, self.num_kv_heads, self.head_offset)
            else:
                r = KVRotation.randomized_hadamard(i, self.num_kv_heads, self.head_size)
            self._rot[key] = r.to(device)
        return self._rot[key]

    def pages(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, PagedK3V2]:
        """vLLM's [blocks, heads, tokens, bytes] view -> core's [blocks, heads, page bytes] and geometry."""
        nb, h, bs, c = kv_cache.shape
        if kv_cache.stride(-1) != 1 or kv_cache.stride(-2) != c:  # flatten would copy: writes would be lost
            raise RuntimeError(f"K3V2: a (block, head) page must be contiguous (layout LBHNC); strides "
                               f"{kv_cache.stride()}")
        if bs not in self._geom:
            g = PagedK3V2(self.fmt, bs, self.guard)
            g.validate()
            self._geom[bs] = g
        return kv_cache.flatten(2), self._geom[bs]

    @staticmethod
    def use_kernels(t: torch.Tensor) -> bool:
        if not t.is_cuda:
            return False
        from bonsai_vllm.triton_runtime import triton

        return triton is not None

    # ------------------------------------------------------------------------------------ vLLM API
    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        n = slot_mapping.shape[0]
        if n == 0 or kv_cache.numel() == 0:
            return
        cache, geom = self.pages(kv_cache)
        rot = self.rotation(layer, key.device)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        geom.write(cache, rot.rotate_k(k), rot.rotate_v(v), slot_mapping[:n], use_kernels=self.use_kernels(key))

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: K3V2Metadata, output: torch.Tensor | None = None, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output is None:
            output = torch.empty(query.shape[0], self.num_heads * self.head_size, dtype=query.dtype,
                                 device=query.device)
        if attn_metadata is None:  # profiling run
            return output.fill_(0)
        md = attn_metadata
        n = md.num_actual_tokens
        out = output[:n].view(n, self.num_heads, self.head_size)
        cache, geom = self.pages(kv_cache)
        rot = self.rotation(layer, query.device)
        q_rot = rot.rotate_q(query[:n].view(n, self.num_heads, self.head_size))
        recorder = _recorder()
        if recorder is not None and key is not None:
            recorder.add(_layer_index(layer), query[:n].view(n, self.num_heads, self.head_size),
                         key[:n].view(n, self.num_kv_heads, self.head_size),
                         value[:n].view(n, self.num_kv_heads, self.head_size))
        qsl = md.query_start_loc_cpu.tolist()
        qlens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
        kernels = self.use_kernels(query)

        # decode and verify rows, grouped by query length (one launch per length)
        groups: dict[int, list[int]] = {}
        prefill_rows = []
        for r, ql in enumerate(qlens):
            if ql == 0:
                continue
            if r < md.num_decodes and ql <= geom.window:
                groups.setdefault(ql, []).append(r)
            else:
                prefill_rows.append(r)
        for ql, rows in groups.items():
            # No host sync per layer: the kernel's split count comes from the host's sequence lengths (an
            # upper bound is fine: a split may be empty), not from n_quant.max().item() on the device.
            kw = {"num_splits": auto_splits(int(md.seq_lens_cpu[rows].max()), len(rows), self.num_kv_heads)} \
                if kernels else {}
            r0, t0 = rows[0], qsl[rows[0]]
            if rows == list(range(r0, r0 + len(rows))):
                # the usual case (vLLM puts decode rows first): consecutive rows of ql tokens each are
                # consecutive tokens, so slices do, with no index tensors to copy over
                tok = slice(t0, t0 + len(rows) * ql)
                table, lens = md.block_table[r0:r0 + len(rows)], md.seq_lens[r0:r0 + len(rows)]
            else:
                tok = torch.tensor([qsl[r] + j for r in rows for j in range(ql)], device=query.device)
                ridx = torch.tensor(rows, device=query.device)
                table, lens = md.block_table[ridx], md.seq_lens[ridx]
            o = geom.decode(q_rot[tok].view(len(rows), ql, self.num_heads, self.head_size), cache, table, lens,
                            self.scale, use_kernels=kernels, **kw)
            out[tok] = rot.unrotate_out(o).reshape(-1, self.num_heads, self.head_size).to(out.dtype)

        if prefill_rows:
            seq_cpu = md.seq_lens_cpu.tolist()
            for r in prefill_rows:
                a, b = qsl[r], qsl[r + 1]
                k = key[a:b].view(b - a, self.num_kv_heads, self.head_size)
                v = value[a:b].view(b - a, self.num_kv_heads, self.head_size)
                o = geom.prefill_row(q_rot[a:b], rot.rotate_k(k), rot.rotate_v(v), cache, md.block_table[r],
                                     int(seq_cpu[r]), self.scale,
                                     use_kernels=kernels and self.prefill_kernel)
                out[a:b] = rot.unrotate_out(o).to(out.dtype)
        return output

