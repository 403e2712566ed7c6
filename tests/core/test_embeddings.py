"""The SSD embedding's lookup (`embeddings`), without vLLM: hot rows on the "device", cold rows from the
memory-mapped export, compared bit for bit with the dense table for random mixes of ids, per vocabulary shard
exactly as vLLM's VocabParallelEmbedding hands them over (local ids; at TP>1 other shards' ids masked to 0).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bonsai_vllm.embeddings import (
    BIN_NAME,
    COLD,
    META_NAME,
    ColdRows,
    EmbeddingFileError,
    build_hot_table,
    export_embedding_table,
    lookup,
    lookup_device_only,
    open_table,
    plan_shard,
    read_meta,
    verify_rows,
)

VOCAB, HIDDEN = 1000, 48  # 1000 is not a multiple of 64: vLLM pads it to 1024, so there is padding to test
PADDED = 1024
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def shards(tp: int) -> list[tuple[int, int, int]]:
    """(start, rows, padded_rows) of each rank, as vLLM's VocabParallelEmbedding splits VOCAB padded to 1024."""
    per = PADDED // tp
    return [(r * per, min((r + 1) * per, VOCAB) - r * per, per) for r in range(tp)]


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16, torch.float32], ids=str)
def export(request, tmp_path_factory):
    gen = torch.Generator().manual_seed(0)
    table = (torch.randn(VOCAB, HIDDEN, generator=gen) * 3).to(request.param)  # [vocab, hidden]
    table[7, :5] = -0.0  # signed zeros and a NaN must survive bit for bit
    table[999, 0] = float("nan")
    counts = {int(i): int(c) for i, c in enumerate(torch.randint(0, 50, (VOCAB,), generator=gen))}
    out = tmp_path_factory.mktemp("embed")
    meta = export_embedding_table(table, out, tensor_name="model.embed_tokens.weight", hot_size=400,
                                  token_counts=counts)
    return table, out, meta


def dense_shard(table: torch.Tensor, start: int, rows: int, padded: int) -> torch.Tensor:
    """What vLLM's loader leaves in a rank's dense parameter: its rows, then zeros for the padding."""
    shard = torch.zeros(padded, table.shape[1], dtype=table.dtype)
    shard[:rows] = table[start:start + rows]
    return shard


def random_global_ids(n: int, gen: torch.Generator) -> torch.Tensor:
    edges = torch.tensor([0, 1, 511, 512, 513, VOCAB - 2, VOCAB - 1, 7, 999])
    return torch.cat([edges, torch.randint(0, VOCAB, (n,), generator=gen), edges])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("hot_count", [0, 1, 37, 400])
def test_lookup_equals_dense_table_bit_for_bit(export, tp, hot_count):
    table, out, meta = export
    _, mapped = open_table(out)
    gen = torch.Generator().manual_seed(hot_count + tp)
    for start, rows, padded in shards(tp):
        plan = plan_shard(meta.hot_ids, hot_count, start=start, rows=rows, padded_rows=padded)
        hot = build_hot_table(table, plan)
        cold = ColdRows(mapped, plan)
        dense = dense_shard(table, start, rows, padded)
        for trial in range(5):
            gids = random_global_ids(300, gen)
            if tp == 1:  # vLLM passes the ids through; the padding ids [VOCAB, PADDED) are legal local ids
                local = torch.cat([gids, torch.arange(VOCAB, PADDED)])
                mask = torch.zeros_like(local, dtype=torch.bool)
            else:  # vLLM's get_masked_input_and_mask: other shards' ids become local 0, zeroed afterwards
                mask = (gids < start) | (gids >= start + rows)
                local = torch.where(mask, 0, gids - start)
            local = local[torch.randperm(local.numel(), generator=gen)].view(-1, 1)  # any shape
            got = lookup(local, hot, plan.slot_of, cold).masked_fill(mask.view(-1, 1, 1), 0)
            want = F.embedding(local, dense).masked_fill(mask.view(-1, 1, 1), 0)
            assert got.shape == want.shape == (local.numel(), 1, HIDDEN)
            assert torch.equal(bits(got), bits(want)), f"rank at {start}, trial {trial}"


def test_hot_rows_split_over_shards(export):
    _, _, meta = export
    plans = [plan_shard(meta.hot_ids, 400, start=s, rows=r, padded_rows=p) for s, r, p in shards(2)]
    ranked = set(meta.hot_ids[:400])
    for plan in plans:
        assert plan.slot_of[0] != COLD  # local row 0 always on the device
        mine = {i for i in ranked if plan.start <= i < plan.start + plan.rows}
        assert set(plan.hot_ids.tolist()) == mine | {plan.start}
        assert (plan.slot_of[plan.rows:] == plan.zero_slot).all()  # padding → the zero row
        assert int((plan.slot_of[: plan.rows] != COLD).sum()) == plan.n_hot
    assert sum(p.n_hot for p in plans) <= 400 + 2


def test_all_hot_and_masked_batches_read_nothing(export):
    table, out, meta = export
    _, mapped = open_table(out)
    start, rows, padded = shards(2)[1]
    plan = plan_shard(meta.hot_ids, 400, start=start, rows=rows, padded_rows=padded)
    cold = ColdRows(mapped, plan)
    hot = build_hot_table(table, plan)
    hot_local = plan.hot_ids - start
    lookup(hot_local.repeat(3), hot, plan.slot_of, cold)
    lookup(torch.zeros(50, dtype=torch.long), hot, plan.slot_of, cold)  # every id of the other shard
    lookup(torch.arange(rows, padded), hot, plan.slot_of, cold)  # padding
    assert cold.reads == 0


def test_cold_rows_read_once_per_distinct_id(export):
    table, out, meta = export
    _, mapped = open_table(out)
    plan = plan_shard(meta.hot_ids, 10, start=0, rows=VOCAB, padded_rows=PADDED)
    cold = ColdRows(mapped, plan)
    cold_ids = (plan.slot_of[:VOCAB] == COLD).nonzero().squeeze(1)[:5]
    got = lookup(cold_ids.repeat(20), build_hot_table(table, plan), plan.slot_of, cold)
    assert cold.reads == 5
    assert torch.equal(bits(got), bits(table[cold_ids.repeat(20)]))


def test_out_of_range_ids_raise_as_the_dense_table_does(export):
    table, out, meta = export
    _, mapped = open_table(out)
    plan = plan_shard(meta.hot_ids, 37, start=0, rows=VOCAB, padded_rows=PADDED)
    hot, cold = build_hot_table(table, plan), ColdRows(mapped, plan)
    for bad in (PADDED, -1):
        with pytest.raises(IndexError):
            F.embedding(torch.tensor([bad]), dense_shard(table, 0, VOCAB, PADDED))
        with pytest.raises(IndexError):
            lookup(torch.tensor([3, bad]), hot, plan.slot_of, cold)


def test_device_only_lookup_exact_when_hot_zero_when_cold(export):
    table, _, meta = export
    plan = plan_shard(meta.hot_ids, 37, start=0, rows=VOCAB, padded_rows=PADDED)
    hot = build_hot_table(table, plan)
    ids = torch.arange(PADDED)
    got = lookup_device_only(ids, hot, plan.slot_of, plan.zero_slot)  # never fails, whatever the id
    is_hot = plan.slot_of != COLD
    is_hot[VOCAB:] = False
    assert torch.equal(bits(got[is_hot]), bits(table[ids[is_hot]]))
    assert (got[~is_hot] == 0).all()


def test_verify_rows_catches_a_stale_export(export, tmp_path):
    table, out, meta = export
    plan = plan_shard(meta.hot_ids, 37, start=0, rows=VOCAB, padded_rows=PADDED)
    _, mapped = open_table(out)
    verify_rows(mapped, table, plan, full=True)  # the export matches its source
    changed = table.clone()
    last_cold = int((plan.slot_of[:VOCAB] == COLD).nonzero()[-1])
    changed[last_cold, 3] += 1  # one element of one cold row: the sampled check includes the edges
    with pytest.raises(EmbeddingFileError, match=f"row {last_cold} of the exported table differs"):
        verify_rows(mapped, changed, plan)
    with pytest.raises(EmbeddingFileError, match="from another model"):
        verify_rows(mapped, table[:, :-1], plan)


def test_missing_and_truncated_exports_are_clear_errors(export, tmp_path):
    _, out, _ = export
    with pytest.raises(EmbeddingFileError, match="no exported embedding table"):
        read_meta(tmp_path / "nowhere")
    (tmp_path / META_NAME).write_bytes((out / META_NAME).read_bytes())
    (tmp_path / BIN_NAME).write_bytes((out / BIN_NAME).read_bytes()[:-HIDDEN])
    with pytest.raises(EmbeddingFileError, match="truncated"):
        read_meta(tmp_path)


def test_plan_rejects_a_hot_count_beyond_the_ranking(export):
    _, _, meta = export
    with pytest.raises(ValueError, match="outside 0"):
        plan_shard(meta.hot_ids, len(meta.hot_ids) + 1, start=0, rows=VOCAB, padded_rows=PADDED)
