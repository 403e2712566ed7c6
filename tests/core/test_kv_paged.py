"""kv/paged.py (K3V2 pages with bf16 sinks + ring, what the vLLM backend stores) with the Triton kernels
against the reference path: the same pages written by the store kernel and by store_ref, and decode/verify
rows through the grouped decode kernel (which skips the sinks' page tokens with q_start) against
decode_ref. Without a GPU through Triton's interpreter (set before the kernels are imported), 24 query /
4 KV heads. The vLLM-side tests (mixed batches, broken variants) are in tests/kv/test_k3v2_backend.py.
"""

from __future__ import annotations

import torch

import interpreter_scope

GPU = torch.cuda.is_available()
KERNELS = [f"bonsai_vllm.kv.kernels.{name}" for name in ("store", "decode")]
if not GPU:  # before Triton is first imported: it reads the switch then, not per kernel
    interpreter_scope.enable()

import pytest  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed: the kernels are optional, the reference is used")

from bonsai_vllm.kv import reference as ref  # noqa: E402
from bonsai_vllm.kv.format import K3V2  # noqa: E402
from bonsai_vllm.kv.paged import PagedK3V2, content_bytes  # noqa: E402
from kv_pages import shuffled_block_table  # noqa: E402

DEV = "cuda" if GPU else "cpu"
# A small head_dim keeps the interpreter quick (the page rules do not depend on it); compiled, the decode
# kernel's unpacked dots need head_dim >= 128 (Triton: every dot dimension >= 16), so the GPU runs the
# real model's 256.
D = 256 if GPU else 64
FMT = K3V2.with_(head_dim=D)
HQ, HKV = 24, 4
BS = 256  # bf16 area: 256 / 32 = 8 slots = 4 sinks + a ring of 4
TOL = 2e-3  # decode kernel: fp16 rounding of the scaled query


@pytest.fixture(scope="module", autouse=True)
def _interpreter_scope():
    """paged.py imports the kernels lazily: run this module's tests with the interpreter on and kernel
    modules imported anew under it (another module may have imported them, or restored the variable)."""
    if GPU:
        yield
        return
    interpreter_scope.restore(KERNELS)  # forget kernels another module imported (with or without it)
    interpreter_scope.enable()
    yield
    interpreter_scope.restore(KERNELS)


def _filled(use_kernels: bool, lens=(5, 300, 600), guard=1, seed=0):
    g = PagedK3V2(FMT, BS, guard)
    g.validate()
    gen = torch.Generator().manual_seed(seed)
    nb, table, seq_slots = shuffled_block_table(lens, BS, 2, gen)
    cache = torch.full((nb, HKV, g.page_bytes), 255, dtype=torch.uint8, device=DEV)
    for n, slots in zip(lens, seq_slots):
        slots = slots.to(DEV)
        k = torch.randn(n, HKV, D, generator=gen).to(DEV)
        v = torch.randn(n, HKV, D, generator=gen).to(DEV)
        for a in range(0, n, 97):  # several chunks, one longer than the ring
            g.write(cache, k[a:a + 97], v[a:a + 97], slots[a:a + 97], use_kernels=use_kernels)
    return g, cache, table.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


def test_geometry():
    assert content_bytes(K3V2) == 168 + 32
    g = PagedK3V2(K3V2, 2176, guard=4)  # the 27B's hybrid-aligned block at TP=2 (kernel block 128)
    assert (g.bf16_slots, g.sink, g.ring, g.window) == (68, 4, 64, 60)
    with pytest.raises(ValueError, match="no recent window"):
        PagedK3V2(FMT, 128, guard=1).validate()


def test_store_kernel_writes_the_reference_pages():
    _, want, _, _ = _filled(use_kernels=False)
    _, got, _, _ = _filled(use_kernels=True)
    qb = PagedK3V2(FMT, BS).quant_bytes
    # bf16 part bit-identical; packed codes may differ by one where (x - min)/scale sits on a rounding edge
    assert torch.equal(got[:, :, qb:], want[:, :, qb:])
    diff = (got[:, :, :qb] != want[:, :, :qb]).float().mean().item()
    assert diff < 1e-3, diff


@pytest.mark.parametrize("ql", [1, 2])
def test_decode_kernel_matches_reference_with_sinks_skipped(ql):
    g, cache, table, lens = _filled(use_kernels=False)
    q = torch.randn(3, ql, HQ, D, generator=torch.Generator().manual_seed(3)).to(DEV)
    want = g.decode(q, cache, table, lens, D ** -0.5, use_kernels=False)
    out = g.decode(q, cache, table, lens, D ** -0.5, use_kernels=True, num_splits=3)
    err = ref.rel_err(out, want)
    assert err < TOL, err
    # q_start matters: with the sinks' page tokens counted twice the kernel misses the reference
    win_k, win_v, n_win, n_quant = g.window_buffers(cache, table, lens)
    from bonsai_vllm.kv.kernels.decode import decode

    qpages, _ = g.views(cache)
    twice = decode(q.contiguous(), qpages, table, n_quant, win_k, win_v, n_win, FMT, BS, D ** -0.5, num_splits=3,
                   q_start=0)
    assert ref.rel_err(twice, want) > 10 * TOL


def test_decode_row_equals_prefill_row_rule():
    # the two paths of the backend compute one rule: a verify row's answer does not depend on the path
    g, cache, table, lens = _filled(use_kernels=False)
    ql = 2
    q = torch.randn(1, ql, HQ, D, generator=torch.Generator().manual_seed(4)).to(DEV)
    b = 2
    n = int(lens[b])
    dec = g.decode(q, cache, table[b:b + 1], lens[b:b + 1], D ** -0.5)
    _, bf = g.views(cache)
    pos = torch.arange(n - ql, n, device=DEV)
    kv = g._bf16_at(bf, table[b][None, :].expand(ql, -1), pos, pos < g.sink).float()  # own tokens, as stored
    pre = g.prefill_row(q[0], kv[:, :, 0], kv[:, :, 1], cache, table[b], n, D ** -0.5)
    assert ref.rel_err(dec[0], pre) < 1e-5


def _prefill_rule_float64(g: PagedK3V2, q, k_own, v_own, cache, table_row, n: int):
    """The rule written out in one piece, float64: context exact where exact_mask says, dequantized
    elsewhere; own tokens bf16-rounded; causal."""
    ql = q.shape[0]
    n_ctx = n - ql
    qpages, bf = g.views(cache)
    kd, vd = ref.decode_slots(ref.gather_ref(qpages, table_row, n_ctx, FMT, BS), FMT)
    pos = torch.arange(n_ctx, device=DEV)
    kv = g._bf16_at(bf, table_row[None, :].expand(n_ctx, -1), pos, pos < g.sink).double()
    ex = g.exact_mask(n, ql)[:n_ctx].to(DEV)[:, None, None]
    keys = torch.cat([torch.where(ex, kv[:, :, 0], kd.double()), k_own.to(torch.bfloat16).double()])
    vals = torch.cat([torch.where(ex, kv[:, :, 1], vd.double()), v_own.to(torch.bfloat16).double()])
    qq = q.double().reshape(ql, HKV, HQ // HKV, D) * D ** -0.5
    s = torch.einsum("qhgd,nhd->qhgn", qq, keys)
    vis = torch.arange(n, device=DEV)[None, :] <= (n_ctx + torch.arange(ql, device=DEV))[:, None]
    s = s.masked_fill(~vis[:, None, None, :], float("-inf"))
    return torch.einsum("qhgn,nhd->qhgd", torch.softmax(s, -1), vals).reshape(ql, HQ, D)


def test_prefill_row_in_chunks_is_one_softmax():
    # The prefill path folds key chunks into a running softmax so that memory stays bounded at 130k
    # tokens; the result must not depend on the chunking, and equals the rule computed in one piece.
    g, cache, table, lens = _filled(use_kernels=False)
    gen = torch.Generator().manual_seed(5)
    b, ql = 2, 37
    n = int(lens[b])
    q = torch.randn(ql, HQ, D, generator=gen).to(DEV)
    k_own = torch.randn(ql, HKV, D, generator=gen).to(DEV)
    v_own = torch.randn(ql, HKV, D, generator=gen).to(DEV)
    want = _prefill_rule_float64(g, q, k_own, v_own, cache, table[b], n)
    whole = g.prefill_row(q, k_own, v_own, cache, table[b], n, D ** -0.5, max_scores=1 << 40)
    chunked = g.prefill_row(q, k_own, v_own, cache, table[b], n, D ** -0.5, max_scores=1)  # 16-token chunks
    assert ref.rel_err(whole, want) < 1e-5
    assert ref.rel_err(chunked, want) < 1e-5
    # a chunk straddles the context and the row's own tokens (n = 600, chunks of 16)
    assert (n - ql) % 16 != 0


@pytest.mark.parametrize("seq, ql", [(2, 37), (2, 3), (1, 16), (0, 5), (0, 4)],
                         ids=["long-context", "within-window", "even-sub-rows", "first-chunk", "context-shorter-than-sinks"])
def test_prefill_row_kernel_matches_torch_path(seq, ql):
    # The prefill row through the grouped decode kernel (sub-rows of 16 // group queries sharing one bf16
    # window) against the torch path, for rows longer than the window (own tokens exact, from the
    # arguments) and within it (exact tail from the ring), with and without context before the sinks.
    g, cache, table, lens = _filled(use_kernels=False)
    gen = torch.Generator().manual_seed(6)
    n = int(lens[seq])
    q = torch.randn(ql, HQ, D, generator=gen).to(DEV)
    if ql <= g.window:  # the row's tokens are in the ring (the backend writes them before attention)
        _, bf = g.views(cache)
        pos = torch.arange(n - ql, n, device=DEV)
        kv = g._bf16_at(bf, table[seq][None, :].expand(ql, -1), pos, pos < g.sink).float()
        k_own, v_own = kv[:, :, 0], kv[:, :, 1]
    else:
        k_own = torch.randn(ql, HKV, D, generator=gen).to(DEV)
        v_own = torch.randn(ql, HKV, D, generator=gen).to(DEV)
    want = g.prefill_row(q, k_own, v_own, cache, table[seq], n, D ** -0.5)
    out = g.prefill_row(q, k_own, v_own, cache, table[seq], n, D ** -0.5, use_kernels=True)
    err = ref.rel_err(out, want)
    assert err < TOL, err


# ----------------------------------------------------------------------------------- long splits
# At many rows the grid is full with one split per row (auto_splits(·, 48, 2) == 1 at the 27B's TP=2 rank
# shape), so one program walks a row's whole context. The GPU's tensor cores add products into the float32
# accumulator truncated at a quarter ulp of the largest term; a kernel that keeps the value codes' offset
# in the accumulator then loses it over tens of thousands of tokens (H200: 4.6e-2 at 48 rows of 40-80k
# tokens, 2.1e-1 for a prefill row at 130k). The interpreter rounds exactly, so these tests run the dots
# through tensor_cores.truncating_dots(), the measured model of that accumulation. Against the kernel
# before the fix (git 5668f3c) they fail: 9.8e-3 (decode), 1.0e-2 (verify), 1.5e-2 (prefill row); after it
# they pass at ~4e-4, as on the H200.
LONG_BS = 2048  # pages of 2048 tokens: 64 bf16 slots, a window of 59 with guard 1
LONG_SPLITS = 1  # what auto_splits gives a 48-row batch at one rank's 12 / 2 heads


def _long_pages(lens, seed):
    g = PagedK3V2(FMT, LONG_BS, 1)
    gen = torch.Generator().manual_seed(seed)
    nb, table, seq_slots = shuffled_block_table(lens, LONG_BS, 1, gen)
    cache = torch.full((nb, HKV_LONG, g.page_bytes), 255, dtype=torch.uint8, device=DEV)
    for n, slots in zip(lens, seq_slots):
        for a in range(0, n, 4096):
            e = min(n, a + 4096)
            g.write(cache, torch.randn(e - a, HKV_LONG, D, generator=gen).to(DEV),
                    torch.randn(e - a, HKV_LONG, D, generator=gen).to(DEV), slots[a:e].to(DEV))
    return g, cache, table.to(DEV), gen


HQ_LONG, HKV_LONG = 6, 1  # one KV head's group of 6 (the interpreter's cost grows with the heads)


def _tensor_cores():
    import contextlib

    if GPU:  # the real ones
        return contextlib.nullcontext()
    from tensor_cores import truncating_dots

    return truncating_dots()


@pytest.mark.parametrize("ql", [1, 2], ids=["decode", "verify"])
def test_decode_kernel_long_split_keeps_small_contributions(ql):
    lens = (32768, 20000)
    g, cache, table, gen = _long_pages(lens, seed=20 + ql)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), ql, HQ_LONG, D, generator=gen).to(DEV)
    want = g.decode(q, cache, table, seq, D ** -0.5)
    with _tensor_cores():
        out = g.decode(q, cache, table, seq, D ** -0.5, use_kernels=True, num_splits=LONG_SPLITS)
    err = ref.rel_err(out, want)
    assert err < TOL, err


def test_prefill_row_kernel_long_context_keeps_small_contributions(monkeypatch):
    # A 512-token chunk at the real shape is 256 sub-rows: auto_splits gives them one split each. Here a few
    # sub-rows would get many short splits, so the split count is pinned to what the real chunk gets.
    from bonsai_vllm.kv.kernels import decode as decode_module

    monkeypatch.setattr(decode_module, "auto_splits", lambda *a, **k: LONG_SPLITS)
    n = 32768 + 6
    g, cache, table, gen = _long_pages((n,), seed=30)
    ql = 6  # within the window: the row's tokens come from the ring, 3 sub-rows of 2 (group 6)
    q = torch.randn(ql, HQ_LONG, D, generator=gen).to(DEV)
    _, bf = g.views(cache)
    pos = torch.arange(n - ql, n, device=DEV)
    kv = g._bf16_at(bf, table[0][None, :].expand(ql, -1), pos, pos < g.sink).float()
    want = g.prefill_row(q, kv[:, :, 0], kv[:, :, 1], cache, table[0], n, D ** -0.5)
    with _tensor_cores():
        out = g.prefill_row(q, kv[:, :, 0], kv[:, :, 1], cache, table[0], n, D ** -0.5, use_kernels=True)
    err = ref.rel_err(out, want)
    assert err < TOL, err
