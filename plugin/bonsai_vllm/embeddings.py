"""The embedding table on SSD: the export format, and the lookup that keeps only hot rows on the device.

The 27B's input embedding (248320 × 5120 bf16, 2.37 GiB) is only ever indexed. Report 002 §4.3
(docs/field-reports.md) found the top 32,000 tokens cover 99.86% of real traffic, so the device keeps
those rows and the rest are read from a file through the OS page cache when a batch needs them.

The lookup (below the format; no vLLM here, `adapters/embedding.py` plugs it in): per vocabulary shard a
`ShardPlan` (which rows the device keeps), `build_hot_table` (the device table), `ColdRows` (the rest, read
from the memory-mapped file) and `lookup` (bit for bit the dense table's rows for any ids);
`lookup_device_only` for the MTP drafter; `verify_rows` to check an export against the checkpoint;
`python -m bonsai_vllm.embeddings` times it (docs/ssd-embeddings.md).

Export format (written by model-fetch, read by the plugin), in one directory:
- `embed_tokens.bin`: the full table, raw row-major, little-endian, no header;
- `embed_tokens.json`: `{"format": "bonsai-embed-v1", "shape": [vocab, hidden], "dtype": "bfloat16",
  "tensor": "<checkpoint tensor name>", "hot_ids": [ids, most frequent first], "sha256": "<of .bin>"}`.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FORMAT = "bonsai-embed-v1"
BIN_NAME = "embed_tokens.bin"
META_NAME = "embed_tokens.json"
EMBED_TENSOR_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class EmbeddingFileError(ValueError):
    """The exported embedding table is missing, truncated or does not match the model."""


@dataclass(frozen=True)
class EmbeddingMeta:
    shape: tuple[int, int]
    dtype: str
    hot_ids: list[int]
    tensor: str
    sha256: str | None = None

    @property
    def row_bytes(self) -> int:
        return self.shape[1] * torch.tensor([], dtype=_DTYPES[self.dtype]).element_size()


def hot_ids_by_count(vocab: int, hot_size: int, token_counts: dict[int, int] | None) -> list[int]:
    """The `hot_size` most frequent ids (ties and unseen ids by ascending id); lowest ids without counts."""
    hot_size = min(hot_size, vocab)
    if not token_counts:
        return list(range(hot_size))
    counts = torch.zeros(vocab, dtype=torch.float64)
    for tid, n in token_counts.items():
        if 0 <= int(tid) < vocab:
            counts[int(tid)] = float(n)
    # Stable sort on descending count keeps ascending id order among equal counts.
    order = torch.sort(-counts, stable=True).indices
    return order[:hot_size].tolist()


def export_embedding_table(table: torch.Tensor, out_dir: Path, *, tensor_name: str, hot_size: int,
                           token_counts: dict[int, int] | None = None) -> EmbeddingMeta:
    """Write `table` [vocab, hidden] and its metadata to `out_dir` (the .json last, via a temp name)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = {v: k for k, v in _DTYPES.items()}[table.dtype]
    data = table.contiguous().view(torch.uint8).numpy().tobytes()  # [vocab, hidden * itemsize]
    digest = hashlib.sha256(data).hexdigest()
    tmp = out_dir / (BIN_NAME + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, out_dir / BIN_NAME)
    meta = EmbeddingMeta(shape=(int(table.shape[0]), int(table.shape[1])), dtype=dtype,
                         hot_ids=hot_ids_by_count(table.shape[0], hot_size, token_counts),
                         tensor=tensor_name, sha256=digest)
    tmp = out_dir / (META_NAME + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "shape": list(meta.shape), "dtype": meta.dtype,
                               "tensor": meta.tensor, "hot_ids": meta.hot_ids, "sha256": digest}) + "\n")
    os.replace(tmp, out_dir / META_NAME)
    return meta


def read_meta(directory: Path) -> EmbeddingMeta:
    """Read and check `embed_tokens.json` and the size of `embed_tokens.bin` (not its hash: that is slow)."""
    directory = Path(directory)
    meta_path, bin_path = directory / META_NAME, directory / BIN_NAME
    if not meta_path.exists() or not bin_path.exists():
        raise EmbeddingFileError(f"no exported embedding table in {directory}: expected {META_NAME} and "
                                 f"{BIN_NAME} (written by bonsai-fetch); unset the SSD-embedding directory "
                                 "to keep the whole table on the GPU")
    try:
        d = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise EmbeddingFileError(f"{meta_path} is not valid JSON ({e}); re-run bonsai-fetch") from None
    if d.get("format") != FORMAT or d.get("dtype") not in _DTYPES:
        raise EmbeddingFileError(f"{meta_path}: format {d.get('format')!r} / dtype {d.get('dtype')!r} not "
                                 f"understood (expected {FORMAT!r}, one of {sorted(_DTYPES)})")
    meta = EmbeddingMeta(shape=tuple(d["shape"]), dtype=d["dtype"], hot_ids=list(d["hot_ids"]),
                         tensor=d.get("tensor", ""), sha256=d.get("sha256"))
    expected = meta.shape[0] * meta.row_bytes
    actual = bin_path.stat().st_size
    if actual != expected:
        raise EmbeddingFileError(f"{bin_path} has {actual} bytes but {meta.shape[0]} × {meta.shape[1]} "
                                 f"{meta.dtype} needs {expected}: the file is truncated or from another "
                                 "model; re-run bonsai-fetch")
    if len(set(meta.hot_ids)) != len(meta.hot_ids) or any(not 0 <= i < meta.shape[0] for i in meta.hot_ids):
        raise EmbeddingFileError(f"{meta_path}: hot_ids must be distinct ids below {meta.shape[0]}")
    return meta


def open_table(directory: Path) -> tuple[EmbeddingMeta, torch.Tensor]:
    """The whole table as a read-only memory-mapped CPU tensor [vocab, hidden] (pages load on first use)."""
    meta = read_meta(directory)
    mm = np.memmap(Path(directory) / BIN_NAME, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():
        # torch warns that the buffer is read-only; it is, on purpose: nothing writes to the table.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(mm, dtype=torch.uint8)  # shares the mapping, no copy
    return meta, raw.view(_DTYPES[meta.dtype]).view(meta.shape[0], meta.shape[1])


# ---------------------------------------------------------------------------------------------------------
# The lookup: a device table of the hot rows, an id → slot map, and the cold rows read from the file.
#
# One `ShardPlan` per vocabulary shard (vLLM's VocabParallelEmbedding gives rank r of n the rows
# [start, start + rows), padded to `padded_rows`; at TP=1 the one shard is the whole vocabulary). The layer
# sees *local* ids 0 … padded_rows−1. Slots of the device table:
#   0 … n_hot−1   the shard's hot rows (global ids `hot_ids`, ascending),
#   n_hot         an all-zero row: the vocabulary padding (vLLM's loader zero-fills padded rows).
# Local row 0 is always hot: at TP>1 vLLM maps every id of another shard to local 0 (and zeroes the result),
# so a cold row 0 would send every other rank's token down the cold path.
# ---------------------------------------------------------------------------------------------------------

COLD = -1  # slot_of value of a row that is not on the device


@dataclass(frozen=True)
class ShardPlan:
    """Which rows of one vocabulary shard the device keeps, and where."""

    start: int  # global id of local row 0
    rows: int  # real rows: global ids start … start + rows − 1
    padded_rows: int  # local ids the layer can be given (rows + vocabulary padding)
    hot_ids: torch.Tensor  # int64 [n_hot]: global id held by each slot, ascending
    slot_of: torch.Tensor  # int32 [padded_rows]: local id → slot, COLD (−1) if read from the file

    @property
    def n_hot(self) -> int:
        return int(self.hot_ids.numel())

    @property
    def zero_slot(self) -> int:
        return self.n_hot

    @property
    def n_slots(self) -> int:
        """Rows of the device table: the hot rows and the zero row."""
        return self.n_hot + 1


def plan_shard(hot_ids: list[int], hot_count: int, *, start: int, rows: int, padded_rows: int) -> ShardPlan:
    """The device rows of the shard [start, start + rows): those among the first `hot_count` of `hot_ids`
    (the export's ranking, most frequent first), plus local row 0; padding maps to the zero slot."""
    if hot_count < 0 or hot_count > len(hot_ids):
        raise ValueError(f"hot_count {hot_count} is outside 0 … {len(hot_ids)} (the ids the export ranks)")
    if rows < 1 or padded_rows < rows:
        raise ValueError(f"shard of {rows} rows padded to {padded_rows}: not a valid shard")
    # Explicitly on the CPU: vLLM builds models under a default-device context, and the plan is host data.
    ranked = torch.tensor(hot_ids[:hot_count], dtype=torch.int64, device="cpu")  # [hot_count]
    mine = ranked[(ranked >= start) & (ranked < start + rows)]
    hot = torch.unique(torch.cat([mine, torch.tensor([start], device="cpu")]))  # sorted; row 0 always hot
    slot_of = torch.full((padded_rows,), COLD, dtype=torch.int32, device="cpu")  # [padded_rows]
    slot_of[hot - start] = torch.arange(hot.numel(), dtype=torch.int32, device="cpu")
    slot_of[rows:] = hot.numel()  # the padding reads the zero row
    return ShardPlan(start=start, rows=rows, padded_rows=padded_rows, hot_ids=hot, slot_of=slot_of)


def build_hot_table(source: torch.Tensor, plan: ShardPlan, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The device table [n_slots, hidden] from a full table `source` [vocab, hidden] (checkpoint or file),
    on `source`'s device; rows converted to `dtype` exactly as vLLM's loader converts them (`copy_`)."""
    dtype = dtype or source.dtype
    table = torch.zeros(plan.n_slots, source.shape[1], dtype=dtype, device=source.device)  # [n_slots, hidden]
    table[: plan.n_hot].copy_(source.index_select(0, plan.hot_ids.to(source.device)))
    return table


class ColdRows:
    """The rows of one shard that are not on the device, read from the memory-mapped export on demand.

    `table` is `open_table`'s [vocab, hidden] mapping; reading a row touches only its pages, which the OS
    keeps in its page cache (shared by every process that maps the file). `reads` counts rows read, for tests.
    """

    def __init__(self, table: torch.Tensor, plan: ShardPlan):
        self.table = table  # [vocab, hidden], CPU, read-only mapping
        self.plan = plan
        self.slot_of = plan.slot_of  # int32 [padded_rows], CPU: cold detection happens on the host
        self.reads = 0

    def gather(self, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the given cold local ids (int64, CPU, distinct) → [k, hidden] CPU, the file's dtype."""
        self.reads += int(local_ids.numel())
        return self.table.index_select(0, local_ids + self.plan.start)


def lookup(ids: torch.Tensor, hot: torch.Tensor, slot_of: torch.Tensor, cold: ColdRows) -> torch.Tensor:
    """Embeddings of local `ids` (int64, any shape) → [*ids.shape, hidden] in hot's dtype, on hot's device.

    Bit for bit the rows of the full table: hot rows are gathered from `hot` with the device `slot_of`;
    the cold ones (usually none) are read once per distinct id from the file and copied into place.
    Out-of-range ids raise IndexError, as the dense table's lookup does.
    """
    flat = ids.reshape(-1)  # [n]
    slots = slot_of.index_select(0, flat)  # [n], on the device
    out = hot.index_select(0, slots.clamp(min=0))  # [n, hidden]; cold positions hold slot 0 for now
    if flat.device.type == "cpu":
        ids_host, slots_host = flat, slots
    else:  # the cold test runs on the host: one small copy (the ids), one sync
        ids_host = flat.cpu()
        slots_host = cold.slot_of.index_select(0, ids_host)
    pos = (slots_host == COLD).nonzero().squeeze(1)  # [k] positions of cold ids
    if pos.numel():
        uniq, inverse = torch.unique(ids_host.index_select(0, pos), return_inverse=True)  # [u], [k]
        rows = cold.gather(uniq).to(dtype=hot.dtype)  # [u, hidden] CPU, converted like copy_ does
        if hot.device.type != "cpu":
            rows = rows.to(hot.device, non_blocking=False)
            pos, inverse = pos.to(hot.device), inverse.to(hot.device)
        out.index_copy_(0, pos, rows.index_select(0, inverse))
    return out.view(*ids.shape, hot.shape[1])


def lookup_device_only(ids: torch.Tensor, hot: torch.Tensor, slot_of: torch.Tensor, zero_slot: int) -> torch.Tensor:
    """The device table alone: hot rows exact, cold ids get the zero row. No host work, so it can run
    inside a captured graph; for a drafter whose guesses the main model verifies."""
    slots = slot_of.index_select(0, ids.reshape(-1))  # [n]
    slots = torch.where(slots < 0, torch.full_like(slots, zero_slot), slots)
    return hot.index_select(0, slots).view(*ids.shape, hot.shape[1])


def verify_rows(table: torch.Tensor, source: torch.Tensor, plan: ShardPlan, *, full: bool = False,
                sample: int = 512) -> None:
    """Check that the export's cold rows of this shard equal `source` (the checkpoint's table), bit for bit.

    `full` compares every cold row (reads the shard's whole part of the file); otherwise the shard's first
    and last rows and `sample` rows spread over it. Raises EmbeddingFileError on the first difference.
    """
    if tuple(source.shape) != tuple(table.shape) or source.dtype != table.dtype:
        raise EmbeddingFileError(f"the exported table is {list(table.shape)} {table.dtype} but the checkpoint's "
                                 f"is {list(source.shape)} {source.dtype}: the export is from another model; "
                                 "re-run bonsai-fetch")
    cold_local = (plan.slot_of[: plan.rows] == COLD).nonzero().squeeze(1)  # [c]
    if not full and cold_local.numel() > sample + 2:
        # float64: vLLM loads under a bf16 default dtype, in which 703.0 rounds to 704.
        pick = torch.linspace(0, cold_local.numel() - 1, sample, dtype=torch.float64, device="cpu").round().long()
        cold_local = torch.unique(torch.cat([cold_local[:1], cold_local[pick], cold_local[-1:]]))
    ints = {2: torch.int16, 4: torch.int32}[table.element_size()]  # compare bits, not values (NaN, −0.0)
    for chunk in cold_local.split(4096):
        glob = chunk + plan.start
        a = table.index_select(0, glob).view(ints)
        b = source.index_select(0, glob.to(source.device)).cpu().view(ints)
        if not torch.equal(a, b):
            bad = int(glob[(a != b).any(dim=1)][0])
            raise EmbeddingFileError(f"row {bad} of the exported table differs from the checkpoint's embedding: "
                                     "the export is stale or from another model; re-run bonsai-fetch")


def benchmark_lookup(vocab: int = 65536, hidden: int = 5120, hot_count: int = 16000, tokens: int = 256,
                     repeats: int = 20, directory: Path | None = None) -> dict[str, float]:
    """Time the lookup on this CPU at the 27B's row width, in seconds per token (best of `repeats`):

    - `dense`: `F.embedding` on a full table (the reference); `all_hot`: our lookup, every id on the device;
    - `cold_cached`: every id cold, rows already in the page cache (the steady state for recurring ids);
    - `cold_disk`: every id cold, the file evicted from the page cache first (unmapped, then
      posix_fadvise DONTNEED), so each row is a read from the disk.
    """
    import tempfile
    import time

    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        table = torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16)  # [vocab, hidden]
        meta = export_embedding_table(table, Path(tmp), tensor_name="bench", hot_size=hot_count)
        plan = plan_shard(meta.hot_ids, hot_count, start=0, rows=vocab, padded_rows=vocab)
        hot = build_hot_table(table, plan)
        cold_pool = (plan.slot_of == COLD).nonzero().squeeze(1)
        all_hot = plan.hot_ids[torch.randint(0, plan.n_hot, (tokens,), generator=gen)]
        all_cold = cold_pool[torch.randperm(cold_pool.numel(), generator=gen)[:tokens]]

        def best(fn) -> float:
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times) / tokens

        def from_disk() -> float:
            times = []
            for _ in range(min(repeats, 5)):
                fd = os.open(Path(tmp) / BIN_NAME, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # no mapping is alive: pages can go
                os.close(fd)
                _, mapped = open_table(Path(tmp))
                cold = ColdRows(mapped, plan)
                t = time.perf_counter()
                lookup(all_cold, hot, plan.slot_of, cold)
                times.append(time.perf_counter() - t)
                del cold, mapped
            return min(times) / tokens

        _, mapped = open_table(Path(tmp))
        cold = ColdRows(mapped, plan)
        lookup(all_cold, hot, plan.slot_of, cold)  # bring the rows into the page cache
        result = {"dense_s": best(lambda: torch.nn.functional.embedding(all_hot, table)),
                  "all_hot_s": best(lambda: lookup(all_hot, hot, plan.slot_of, cold)),
                  "cold_cached_s": best(lambda: lookup(all_cold, hot, plan.slot_of, cold))}
        cold = mapped = None  # no mapping may stay alive for from_disk's fadvise to drop the pages
        result["cold_disk_s"] = from_disk()
        return result


if __name__ == "__main__":  # python -m bonsai_vllm.embeddings [tokens ...]: the lookup's cost per token
    import sys

    for n in [int(a) for a in sys.argv[1:]] or [1, 16, 256]:
        r = benchmark_lookup(tokens=n)
        print(f"{n:4d} tokens per batch: " + ", ".join(f"{k[:-2]} {v * 1e6:.2f} µs/token" for k, v in r.items()))
