"""The tiny ternary model served through the plugin equals its `--to-dense` twin served by stock vLLM.

Four servers, one after another (each ~1 min on this CPU):
- `ternary`: the prism_ternary checkpoint, our plugin doing the maths;
- `dense`: the same weights as an ordinary bf16 checkpoint (`bonsai-convert --to-dense`), plugins off;
- `jitter`: the dense twin with every weight moved by about one bf16 ulp — its distance to `dense` is the
  noise floor of bf16 rounding (vLLM-CPU's GDN runs only in bf16, so a float32 twin is not an option);
- `broken`: the ternary checkpoint with the down_proj sign vector replaced — what a plugin that rotated
  with the wrong signs would serve. The criterion must reject it, or it proves nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bonsai_vllm.core.convert import convert_to_dense, convert_to_ternary
from bonsai_vllm.core.format import encode_signs
from safetensors.torch import load_file, save_file
from bonsai_vllm.devserver import VllmServer
from compare import greedy_tokens, logprob_difference

PLUGINS_OFF = {"VLLM_PLUGINS": ""}


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("ternary")
    ternary = convert_to_ternary(tiny_model, root / "ternary", seed=0)
    dense = convert_to_dense(ternary, root / "dense")
    broken = root / "broken"
    shutil.copytree(ternary, broken)
    cfg = json.loads((broken / "config.json").read_text())
    width = str(3 * 1024)  # down_proj input width of the tiny model
    flipped = torch.ones(int(width))
    flipped[::3] = -1
    cfg["quantization_config"]["signs"][width] = encode_signs(flipped)
    (broken / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"ternary": ternary, "dense": dense, "broken": broken, "jitter": jittered_copy(dense, root / "jitter")}


def jittered_copy(src: Path, out: Path) -> Path:
    """A copy whose matrices are multiplied by (1 + u·2⁻⁸), u uniform in [−1, 1]: about one bf16 ulp."""
    shutil.copytree(src, out)
    gen = torch.Generator().manual_seed(1)
    for path in out.glob("*.safetensors"):
        tensors = load_file(path)
        for name, t in tensors.items():
            if t.ndim == 2 and t.is_floating_point():
                u = torch.rand(t.shape, generator=gen) * 2 - 1
                tensors[name] = (t.float() * (1 + u * 2**-8)).to(t.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return out


def _serve_and_score(model, reference_url, env=None, args=()):
    with VllmServer(model, list(args), env=env) as srv:
        return srv, logprob_difference(srv.url, reference_url)


@pytest.fixture(scope="module")
def dense_server(checkpoints):
    with VllmServer(checkpoints["dense"], env=PLUGINS_OFF) as srv:
        yield srv


@pytest.fixture(scope="module")
def noise_floor(checkpoints, dense_server):
    _, diff = _serve_and_score(checkpoints["jitter"], dense_server.url, env=PLUGINS_OFF)
    print(f"\nnoise floor (dense twin vs its one-ulp jitter): {diff}")
    return diff


@pytest.fixture(scope="module")
def ternary_server(checkpoints, dense_server):
    with VllmServer(checkpoints["ternary"]) as srv:
        yield srv


def tolerance(floor) -> tuple[float, float]:
    # Ternary maths runs in float32 and rounds once to bf16: it may differ from the bf16 dense twin by a few
    # times the bf16 noise floor, never by more.
    return 4 * floor.mean + 0.01, 4 * floor.max + 0.05


def test_dense_twin_runs_without_plugin(dense_server):
    assert "bonsai_vllm plugin loaded" not in dense_server.log_path.read_text(errors="replace")


def test_ternary_matches_dense_twin(ternary_server, dense_server, noise_floor):
    assert "bonsai_vllm plugin loaded" in ternary_server.log_path.read_text(errors="replace")
    diff = logprob_difference(ternary_server.url, dense_server.url)
    mean_tol, max_tol = tolerance(noise_floor)
    print(f"\nternary vs dense twin: {diff} (tolerance mean {mean_tol:.4f}, max {max_tol:.4f})")
    assert diff.mean <= mean_tol and diff.max <= max_tol, f"{diff} exceeds tolerance ({mean_tol}, {max_tol})"


def test_broken_signs_are_caught(checkpoints, dense_server, noise_floor):
    _, diff = _serve_and_score(checkpoints["broken"], dense_server.url)
    mean_tol, max_tol = tolerance(noise_floor)
    print(f"\nbroken variant vs dense twin: {diff}")
    assert diff.mean > 5 * mean_tol, f"a wrong sign vector went unnoticed: {diff}"


COUNTING = "Counting up: " + " ".join(str(i) for i in range(1, 30))


def test_greedy_tokens_identical_where_decisive(ternary_server, dense_server):
    # The session's tiny model is briefly trained on a corpus with this counting line, so even after
    # ternary quantization it continues the count decisively.
    ids_t, _ = greedy_tokens(ternary_server.url, COUNTING, 32)
    ids_d, margins = greedy_tokens(dense_server.url, COUNTING, 32)
    # If the two servers' logprobs differ by at most δ per token (measured on the fixed texts), a greedy
    # token can only flip where its top-1/top-2 margin is below 2δ. Every one of the 32 must be wider than
    # that, and then all must be identical.
    delta = logprob_difference(ternary_server.url, dense_server.url).max
    print(f"\ngreedy: smallest top-1/top-2 margin {min(margins):.3f}, flip threshold 2δ = {2 * delta:.3f}")
    assert min(margins) > 2 * delta, f"the tiny model is not decisive on the counting prompt: {margins}"
    assert ids_t == ids_d
