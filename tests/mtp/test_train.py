"""Training the MTP head on CPU with a random tiny model (bonsai-tiny --mtp) and real hidden states of that
model (its transformers forward, the last decoder layer's output: what vLLM's extraction at layer id
num_hidden_layers returns). The token sequences follow per-sequence cycles, so the next-next token is
learnable; the random head starts near chance.

- training lowers the held-out loss and raises the held-out top-1 agreement (the acceptance estimate);
- a run stopped at a checkpoint and resumed ends with the same weights as an uninterrupted run;
- the written mtp.safetensors has the checkpoint's names, dtypes and shapes (model-fetch's swap check
  accepts it), and differs from the original head;
- bad input: a model without mtp.*, hidden states of another width, a checkpoint of another run.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bonsai_vllm.mtp.io import MTPInputError, load_frozen, write_head
from bonsai_vllm.mtp.train import TrainConfig, Trainer, load_samples

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from bonsai_vllm.testing.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("mtp-tiny"), seed=0, train_steps=0, mtp=True)


def last_layer_states(model_dir: Path, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The last decoder layer's output (before the final norm) for each sequence, by transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    got: list[torch.Tensor] = []
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, inp, out: got.append((out[0] if isinstance(out, tuple) else out)[0].detach()))
    with torch.no_grad():
        for ids in seqs:
            model(torch.tensor([ids]))
    hook.remove()
    return got


@pytest.fixture(scope="module")
def hidden_dir(tiny, tmp_path_factory) -> Path:
    rng = random.Random(0)
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    cycles = [rng.sample(range(10, vocab), 5) for _ in range(3)]
    seqs = []
    for i in range(12):
        c = cycles[i % 3]
        start = rng.randrange(5)
        seqs.append([c[(start + j) % 5] for j in range(32)])
    out = tmp_path_factory.mktemp("hidden")
    for i, (ids, h) in enumerate(zip(seqs, last_layer_states(tiny, seqs))):
        save_file({"hidden_states": h[:, None].to(torch.bfloat16).contiguous(),
                   "token_ids": torch.tensor(ids, dtype=torch.int64)}, str(out / f"{i:03d}.safetensors"))
    return out


CFG = TrainConfig(steps=60, lr=2e-3, batch=2, holdout=0.25, seed=0, save_every=20, eval_every=20)


def test_training_raises_held_out_acceptance(tiny, hidden_dir, tmp_path):
    frozen = load_frozen(tiny)
    trainer = Trainer(frozen, load_samples(hidden_dir, frozen.shape.hidden_size), CFG, tmp_path / "ckpt.pt")
    before = trainer.evaluate()
    result = trainer.run(progress=False)
    print(f"\nheld-out loss {before[0]:.3f} -> {result['held_loss']:.3f}, "
          f"acceptance {before[1]:.1%} -> {result['held_acceptance']:.1%}")
    assert before[1] < 0.2
    assert result["held_loss"] < 0.5 * before[0]
    assert result["held_acceptance"] > 0.8
    out = write_head(tmp_path / "mtp.safetensors", trainer.weights(), frozen.head)
    written = load_file(str(out))
    assert {k: (v.dtype, v.shape) for k, v in written.items()} == \
        {f"mtp.{k}": (v.dtype, v.shape) for k, v in frozen.head.items()}
    assert not torch.equal(written["mtp.fc.weight"], frozen.head["fc.weight"])
    # model-fetch's swap check (BONSAI_MTP_REPO) takes it
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "model-fetch"))
    from bonsai_fetch import st
    from bonsai_fetch.layout import check_mtp_head, mtp_signature

    (shard,) = tiny.glob("*.safetensors")
    check_mtp_head(st.read_header(out), mtp_signature(st.read_header(shard)), str(out))


def test_resume_continues_where_it_stopped(tiny, hidden_dir, tmp_path):
    frozen = load_frozen(tiny)
    samples = load_samples(hidden_dir, frozen.shape.hidden_size)
    whole = Trainer(frozen, samples, CFG, None)
    whole.run(progress=False)
    ckpt = tmp_path / "ckpt.pt"
    first = Trainer(frozen, samples, TrainConfig(**{**CFG.__dict__, "steps": 20}), ckpt)
    first.run(progress=False)
    resumed = Trainer(frozen, samples, CFG, ckpt)
    assert resumed.step == 20
    resumed.run(progress=False)
    for name, w in whole.weights().items():
        assert torch.equal(w, resumed.weights()[name]), name
    # a checkpoint of another run (another split) is refused, not silently mixed in
    with pytest.raises(MTPInputError, match="another run"):
        Trainer(frozen, samples, TrainConfig(**{**CFG.__dict__, "seed": 1}), ckpt)


def test_bad_inputs(tiny, hidden_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(tiny, bare)
    (shard,) = bare.glob("*.safetensors")
    save_file({k: v for k, v in load_file(str(shard)).items() if not k.startswith("mtp.")}, str(shard))
    with pytest.raises(MTPInputError, match="no mtp"):
        load_frozen(bare)
    frozen = load_frozen(tiny)
    with pytest.raises(MTPInputError, match="width 1024 but the model's hidden_size is 2048"):
        load_samples(hidden_dir, 2048)
    with pytest.raises(MTPInputError, match="no hidden-state files"):
        load_samples(tmp_path, frozen.shape.hidden_size)
    wrong = dict(frozen.head)
    wrong["fc.weight"] = wrong["fc.weight"][:, :8]
    target = tmp_path / "out" / "mtp.safetensors"
    with pytest.raises(MTPInputError, match="shape"):
        write_head(target, wrong, frozen.head)
    assert not target.exists()
