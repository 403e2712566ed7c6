"""Shared fixtures: tiny models generated once per session, and the server-log hook.

A test module that needs a vLLM server starts one module-scoped (see `bonsai_vllm.testing.devserver`): vLLM takes about
a minute to start on this CPU, so tests share servers wherever their arguments allow.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

# The repository root, for the developer tools and benchmarks the tests drive (tools/, benchmarks/): they are
# not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bonsai_vllm.testing.devserver import RUNNING, VllmServer  # noqa: E402
from compare import PLUGINS_OFF  # noqa: E402


# Enough AdamW steps (~2 min here) that the tiny model continues its corpus's counting line decisively,
# even after ternary quantization; tests that compare greedy tokens rely on it.
TINY_TRAIN_STEPS = 80


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny dense Qwen3.5-hybrid checkpoint (seed 0), briefly trained on the built-in corpus."""
    from bonsai_vllm.testing.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("tiny-dense"), seed=0, train_steps=TINY_TRAIN_STEPS)


@pytest.fixture(scope="session")
def tiny_mtp(tiny_model, tmp_path_factory):
    """The session's tiny model plus a random one-layer MTP head (as `bonsai-tiny --mtp` writes it): most drafts
    rejected (tests/kv/test_k3v2_served.py), or the head to retrain (tests/mtp/test_mtp_train_served.py). Read only."""
    from transformers import AutoConfig

    from bonsai_vllm.testing.tiny import make_mtp_tensors

    out = tmp_path_factory.mktemp("tiny-mtp") / "model"
    shutil.copytree(tiny_model, out)
    (weights,) = out.glob("*.safetensors")
    tensors = load_file(weights)
    tensors.update(make_mtp_tensors(AutoConfig.from_pretrained(tiny_model), seed=1))
    save_file(dict(sorted(tensors.items())), weights, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


@pytest.fixture(scope="session")
def ternary_checkpoints(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """The tiny model in prism_ternary form, its dense twin, and two variants the comparisons need.

    - `ternary`: bonsai-convert of the tiny model (signs seeded 0);
    - `dense`: `--to-dense` of `ternary`: the same function as an ordinary bf16 checkpoint;
    - `jitter`: `dense` with every matrix moved by about one bf16 ulp (the bf16 noise floor);
    - `broken`: `ternary` with the down_proj sign vector replaced (what a wrong rotation would serve).
    """
    from bonsai_vllm.checkpoint.convert import convert_to_dense, convert_to_ternary
    from bonsai_vllm.ternary.format import encode_signs

    root = tmp_path_factory.mktemp("ternary")
    ternary = convert_to_ternary(tiny_model, root / "ternary", seed=0, progress=False)
    dense = convert_to_dense(ternary, root / "dense", progress=False)
    broken = root / "broken"
    shutil.copytree(ternary, broken)
    cfg = json.loads((broken / "config.json").read_text())
    width = str(3 * 1024)  # down_proj input width of the tiny model
    flipped = torch.ones(int(width))
    flipped[::3] = -1
    cfg["quantization_config"]["signs"][width] = encode_signs(flipped)
    (broken / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"ternary": ternary, "dense": dense, "broken": broken, "jitter": _jittered_copy(dense, root / "jitter")}


def _jittered_copy(src: Path, out: Path) -> Path:
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


@pytest.fixture(scope="session")
def dense_server(ternary_checkpoints):
    """Stock vLLM (no plugin) serving the dense twin at TP=1: the reference for every comparison."""
    with VllmServer(ternary_checkpoints["dense"], env=PLUGINS_OFF) as srv:
        yield srv


@pytest.fixture(scope="session")
def ternary_server(ternary_checkpoints):
    """Our plugin serving the ternary checkpoint at TP=1, with vLLM's compiled forward: dynamo traces the
    ternary layers' custom op as vLLM does in production (other test servers run eager: devserver)."""
    with VllmServer(ternary_checkpoints["ternary"], compiled=True) as srv:
        yield srv


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the log of every vLLM server still running to a failing test's report."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in RUNNING:
            report.sections.append((f"vLLM server log ({server.url}, tail)", server.log_tail()))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long end-to-end tests (CI runs them; -m 'not slow' skips them "
                                       "while iterating)")
