"""The SSD embedding in vLLM 0.32: the main Qwen3.5 model's `embed_tokens` keeps only hot rows on the device.

The lookup itself is `embeddings` (vLLM-free); this file plugs it into vLLM (report 002 §4.3 in
docs/field-reports.md; docs/ssd-embeddings.md):

- **Where.** vLLM 0.32's `Qwen3_5Model.__init__` builds `VocabParallelEmbedding(vocab, hidden)` with no
  quant_config, so no quantization hook reaches it. We wrap that `__init__`: while it runs, the name
  `VocabParallelEmbedding` in `vllm.model_executor.models.qwen3_5` builds the layer with
  `quant_method=SSDEmbeddingMethod(...)`. The layer is therefore *created* small: its `weight` parameter is
  the hot table [hot rows of this shard + 1 zero row, hidden], never the full [vocab/tp, hidden] shard. vLLM's
  own `VocabParallelEmbedding.forward` is unchanged (TP masking, zeroing, all-reduce); only
  `quant_method.embedding(layer, local_ids)` is ours.
- **The lookup in the compiled forward.** `embedding()` calls `torch.ops.bonsai.ssd_embedding`, an opaque
  custom op (torch.compile traces its fake, never its data-dependent cold path), then gathers its rows once
  more through an opaque 0 … n−1 index so that the graph keeps the dense table's `aten.embedding` and
  inductor fuses the first layer exactly as for the dense table (bit-identical compiled output). The cold
  rows' mapping is process-local state, found through a string key (as `adapters.allreduce` finds its group).
- **Loading.** `embed_tokens.weight` gets our loader: it checks the export against the checkpoint's tensor
  (a sample of cold rows, bit for bit; all of them with `BONSAI_SSD_EMBED_VERIFY=full`) and copies only the
  hot rows to the device.
- **The MTP drafter.** vLLM shares the main model's `embed_tokens` module with an MTP drafter (PP=1). The
  drafter's `embed_input_ids` is routed to the device table alone (`lookup_device_only`: cold ids get the
  zero row): no host work, so it is safe in a captured graph and cannot fail on a cold id. Its drafts are
  verified by the main model, so the output does not change.
- **Compile cache.** vLLM caches compiled graphs under `VllmConfig.compute_hash()`, which does not see our
  environment; while the SSD embedding is on, that hash also covers its settings, so a graph compiled for the
  dense table is never loaded for the hot table (or the reverse).

Configuration (environment, read in every process vLLM starts):
- `BONSAI_SSD_EMBED_DIR`: the directory of the export (`embed_tokens.bin` + `.json`, bonsai-fetch writes it
  to `<model>/embed_ssd`); unset or empty = off, the full table stays on the device.
- `BONSAI_SSD_EMBED_HOT` (default 32000, or all the export ranks if fewer): device rows, the most frequent.
- `BONSAI_SSD_EMBED_VERIFY`: `sample` (default), `full` or `off`: how much of the export is compared with
  the checkpoint at load.
A missing, truncated or mismatched export stops start-up with an `EmbeddingFileError` saying what to do.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from torch.nn import Parameter

from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.utils import set_weight_attrs

from bonsai_vllm import settings as bonsai_settings
from bonsai_vllm.embeddings import (
    ColdRows,
    EmbeddingFileError,
    EmbeddingMeta,
    ShardPlan,
    build_hot_table,
    lookup,
    lookup_device_only,
    open_table,
    plan_shard,
    read_meta,
    verify_rows,
)

logger = logging.getLogger("vllm.bonsai")

ENV_DIR = "BONSAI_SSD_EMBED_DIR"
ENV_HOT = "BONSAI_SSD_EMBED_HOT"
ENV_VERIFY = "BONSAI_SSD_EMBED_VERIFY"
DEFAULT_HOT = 32000
VERIFY_MODES = bonsai_settings.setting(ENV_VERIFY).choices  # sample, full, off


@dataclass(frozen=True)
class Settings:
    """The SSD embedding's configuration, validated against the export's metadata."""

    directory: Path
    hot_count: int
    verify: str
    meta: EmbeddingMeta

    def fingerprint(self) -> str:
        """What the compiled graph and the parameter shapes depend on: the hot set (not the directory)."""
        ranked = ",".join(map(str, self.meta.hot_ids[: self.hot_count]))
        return hashlib.sha256(f"{self.meta.shape}|{self.meta.dtype}|{ranked}".encode()).hexdigest()[:16]


def read_settings(environ: Mapping[str, str] | None = None) -> Settings | None:
    """The settings from `environ`, else the process environment (bonsai_vllm.settings); None when
    `BONSAI_SSD_EMBED_DIR` is unset or empty (the feature is off).

    Raises EmbeddingFileError for a missing or truncated export, ValueError for a malformed setting.
    """
    directory = bonsai_settings.get(ENV_DIR, environ)
    if directory is None:
        return None
    meta = read_meta(directory)  # presence, JSON, dtype, exact .bin size, hot ids in range
    hot_count = bonsai_settings.get(ENV_HOT, environ)  # a whole number >= 0, or None when unset
    if hot_count is not None:
        if hot_count > len(meta.hot_ids):
            raise EmbeddingFileError(f"{ENV_HOT}={hot_count} but the export in {directory} ranks only "
                                     f"{len(meta.hot_ids)} ids: re-export with a larger hot size (bonsai-fetch "
                                     f"--hot-vocab {hot_count}) or set {ENV_HOT} ≤ {len(meta.hot_ids)}")
    else:
        hot_count = min(DEFAULT_HOT, len(meta.hot_ids))
    verify = bonsai_settings.get(ENV_VERIFY, environ)  # one of VERIFY_MODES
    return Settings(directory=directory, hot_count=hot_count, verify=verify, meta=meta)


# ------------------------------------------------------------------------------------------------------
# The custom op. Its arguments are what the graph holds (ids, the hot table parameter, the slot map buffer);
# the memory-mapped file is process state found by `key`, which is stable across runs (compiled graphs are
# cached on disk with the key baked in).
# ------------------------------------------------------------------------------------------------------

_STORES: dict[str, ColdRows] = {}


@torch.library.custom_op("bonsai::ssd_embedding", mutates_args=())
def ssd_embedding_op(ids: torch.Tensor, hot: torch.Tensor, slot_of: torch.Tensor,
                     key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ids int64 [n] → (rows [n, hidden], order int64 [n] = 0 … n−1); see `SSDEmbeddingMethod.embedding`."""
    store = _STORES.get(key)
    if store is None:
        raise RuntimeError(f"SSD embedding {key!r} is not set up in this process (pid {os.getpid()}): the "
                           f"layer was not built by the bonsai plugin; check that {ENV_DIR} is set in every "
                           "process vLLM starts")
    if ids.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the SSD embedding's cold path reads the file on the host and cannot be captured "
                           "in a CUDA graph: serve the multimodal checkpoint (vLLM embeds outside the graph) "
                           f"or use --enforce-eager, or unset {ENV_DIR} (docs/ssd-embeddings.md)")
    rows = lookup(ids, hot, slot_of, store)
    return rows, torch.arange(rows.shape[0], device=rows.device)


@ssd_embedding_op.register_fake
def _(ids: torch.Tensor, hot: torch.Tensor, slot_of: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    return hot.new_empty((ids.shape[0], hot.shape[1])), ids.new_empty((ids.shape[0],), dtype=torch.int64)


# ------------------------------------------------------------------------------------------------------
# The embedding method
# ------------------------------------------------------------------------------------------------------


class SSDEmbeddingMethod(QuantizeMethodBase):
    """`VocabParallelEmbedding` method: a device table of this shard's hot rows, the rest from the file.

    `embedding(layer, local_ids)` returns exactly the rows the dense table would (vLLM's forward passes local
    ids of the rank's vocabulary shard; ids of other shards arrive as local 0, which is always hot).
    """

    def __init__(self, settings: Settings, name: str = "embed_tokens"):
        super().__init__()
        self.settings = settings
        self.name = name
        self.key = ""  # set in create_weights, once the layer's rank is known
        self.plan: ShardPlan | None = None

    @property
    def store(self) -> ColdRows:
        return _STORES[self.key]

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        meta = self.settings.meta
        if getattr(layer, "num_added_embeddings", 0):
            raise NotImplementedError("the SSD embedding does not support added (LoRA) vocabulary; unset "
                                      f"{ENV_DIR}")
        if (layer.org_vocab_size, layer.embedding_dim) != tuple(meta.shape):
            raise EmbeddingFileError(f"the export in {self.settings.directory} is {list(meta.shape)} but the "
                                     f"model's embed_tokens is [{layer.org_vocab_size}, {layer.embedding_dim}]: "
                                     f"it is from another model; re-run bonsai-fetch or unset {ENV_DIR}")
        si = layer.shard_indices
        plan = plan_shard(meta.hot_ids, self.settings.hot_count, start=si.org_vocab_start_index,
                          rows=si.num_org_elements, padded_rows=layer.num_embeddings_per_partition)
        _, mapped = open_table(self.settings.directory)  # [vocab, hidden], read-only mapping
        self.plan = plan
        self.key = f"{self.name}:tp{layer.tp_rank}of{layer.tp_size}"
        _STORES[self.key] = ColdRows(mapped, plan)

        hidden = layer.embedding_dim
        weight = Parameter(torch.empty(plan.n_slots, hidden, dtype=params_dtype), requires_grad=False)
        # No output_dim: nothing in vLLM may shard or resize this table; our loader fills it.
        attrs = {k: v for k, v in extra_weight_attrs.items() if k != "weight_loader"}
        set_weight_attrs(weight, {**attrs, "weight_loader": self.load_weight})
        layer.register_parameter("weight", weight)
        layer.register_buffer("ssd_slot_of", plan.slot_of.to(weight.device), persistent=False)  # int32 [padded]

        item = torch.tensor([], dtype=params_dtype).element_size()
        full_bytes = layer.num_embeddings_per_partition * hidden * item
        kept = plan.n_slots * hidden * item + plan.slot_of.numel() * plan.slot_of.element_size()
        logger.info("SSD embedding: rank %d/%d keeps %d of %d rows on the device (%.1f MiB instead of %.1f MiB, "
                    "hot %d overall); cold rows from %s", layer.tp_rank, layer.tp_size, plan.n_slots,
                    layer.num_embeddings_per_partition, kept / 2**20, full_bytes / 2**20,
                    self.settings.hot_count, self.settings.directory)

    def load_weight(self, param: Parameter, loaded_weight: torch.Tensor) -> None:
        """The checkpoint's full table [vocab, hidden] → only this shard's hot rows on the device."""
        assert self.plan is not None
        if tuple(loaded_weight.shape) != tuple(self.settings.meta.shape):
            raise EmbeddingFileError(f"the checkpoint's embed_tokens is {list(loaded_weight.shape)} but the export "
                                     f"in {self.settings.directory} is {list(self.settings.meta.shape)}: re-run "
                                     f"bonsai-fetch or unset {ENV_DIR}")
        if self.settings.verify != "off":
            verify_rows(self.store.table, loaded_weight, self.plan, full=self.settings.verify == "full")
        param.data.copy_(build_hot_table(loaded_weight, self.plan, dtype=param.dtype))

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        # input_: int64 local ids, any shape → [*input_.shape, hidden]
        rows, order = torch.ops.bonsai.ssd_embedding(input_.reshape(-1), layer.weight, layer.ssd_slot_of, self.key)
        # rows [n, hidden] are already the answer; gathering them again through `order` (0 … n−1, opaque to the
        # compiler) leaves an aten.embedding in the graph where the dense table had one. Inductor then fuses
        # and orders the first layer's sums exactly as for the dense table, so the compiled model's output is
        # bit-identical too (read directly, the rows changed its fusion: prompt logprobs moved by ≤ 0.002).
        return torch.nn.functional.embedding(order.view(input_.shape), rows)

    def apply(self, layer: torch.nn.Module, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError("the SSD embedding is an input embedding; it cannot serve as an LM head "
                                  "(tied embeddings are not supported)")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None


def device_only_forward(layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
    """`VocabParallelEmbedding.forward` over the device table alone (cold ids → zero row), for the drafter."""
    zero_slot = layer.weight.shape[0] - 1
    if layer.tp_size == 1:
        return lookup_device_only(input_.long(), layer.weight, layer.ssd_slot_of, zero_slot)
    from vllm.distributed import tensor_model_parallel_all_reduce
    from vllm.model_executor.layers.vocab_parallel_embedding import get_masked_input_and_mask

    si = layer.shard_indices
    masked, mask = get_masked_input_and_mask(input_, si.org_vocab_start_index, si.org_vocab_end_index,
                                             si.num_org_vocab_padding, si.added_vocab_start_index,
                                             si.added_vocab_end_index)
    out = lookup_device_only(masked.long(), layer.weight, layer.ssd_slot_of, zero_slot)  # [n, hidden]
    out = out.masked_fill(mask.unsqueeze(-1), 0)
    if not layer.reduce_results:
        return out
    group = layer.parallel_group
    return group.all_reduce(out) if group is not None else tensor_model_parallel_all_reduce(out)


# ------------------------------------------------------------------------------------------------------
# Installation (from the plugin's register(), in every process)
# ------------------------------------------------------------------------------------------------------


def install_ssd_embedding(environ: Mapping[str, str] | None = None) -> Settings | None:
    """Validate the settings and hook Qwen3.5 (idempotent). Off, and nothing patched, without the directory.

    Runs in the API server first, so a missing or truncated export stops start-up before any model loads.
    """
    settings = read_settings(environ)
    if settings is None:
        return None
    from vllm.config import VllmConfig, get_current_vllm_config
    from vllm.model_executor.models import qwen3_5, qwen3_5_mtp

    model_cls = qwen3_5.Qwen3_5Model
    if getattr(model_cls, "_bonsai_ssd_embedding", None) is not None:
        return settings
    original_init = model_cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, vllm_config=None, prefix: str = "", **kwargs) -> None:
        config = vllm_config if vllm_config is not None else get_current_vllm_config()
        if getattr(config.model_config.hf_text_config, "tie_word_embeddings", False):
            raise EmbeddingFileError(f"{ENV_DIR} is set but this model ties its LM head to the input embedding, "
                                     "which must then stay whole on the device; unset it for this model")
        method = SSDEmbeddingMethod(settings, name=f"{prefix or 'model'}.embed_tokens")
        plain = qwen3_5.VocabParallelEmbedding
        qwen3_5.VocabParallelEmbedding = functools.partial(plain, quant_method=method)
        try:
            original_init(self, *args, vllm_config=vllm_config, prefix=prefix, **kwargs)
        finally:
            qwen3_5.VocabParallelEmbedding = plain
        if self.embed_tokens.quant_method is not method:
            raise RuntimeError("the SSD embedding hook did not reach Qwen3_5Model.embed_tokens (vLLM changed?); "
                               f"unset {ENV_DIR}")

    model_cls.__init__ = __init__
    model_cls._bonsai_ssd_embedding = settings

    # The drafter: the device table alone when it shares our layer.
    mtp_cls = qwen3_5_mtp.Qwen3_5MultiTokenPredictor
    original_embed = mtp_cls.embed_input_ids

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(getattr(self.embed_tokens, "quant_method", None), SSDEmbeddingMethod):
            return device_only_forward(self.embed_tokens, input_ids)
        return original_embed(self, input_ids)

    mtp_cls.embed_input_ids = embed_input_ids

    # Compiled graphs and startup plans are cached by this hash; make it see the hot set.
    original_hash = VllmConfig.compute_hash
    tag = settings.fingerprint()

    @functools.wraps(original_hash)
    def compute_hash(self, *args, **kwargs) -> str:
        base = original_hash(self, *args, **kwargs)
        return hashlib.sha256(f"{base}|bonsai-ssd-embed|{tag}".encode()).hexdigest()[: len(base)]

    VllmConfig.compute_hash = compute_hash
    logger.info("SSD embedding on: %d hot rows of %d from %s (%s=%s)", settings.hot_count, settings.meta.shape[0],
                settings.directory, ENV_VERIFY, settings.verify)
    return settings
