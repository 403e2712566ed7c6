"""Training the MTP head on (hidden states, token ids) of the served model's own answers.

A sample is one sequence: its token ids t_0..t_{n-1} and the main model's last-layer output h_0..h_{n-1}
(vLLM's hidden-state extraction at layer id num_hidden_layers: *before* the final norm, which is applied
here with the frozen norm weight, as vLLM hands the drafter the normed state). The head sees (h_i,
t_{i+1}) and is scored on t_{i+2} (cross-entropy through the frozen LM head). Held-out top-1 agreement
with t_{i+2} is the greedy acceptance estimate of one speculative token.

Weights are computed in bf16 from fp32 master copies (AdamW state fp32); a checkpoint (master weights,
optimizer, step, split) is written atomically every `save_every` steps and a rerun resumes from it.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.nn import functional as F
from tqdm import tqdm

from bonsai_vllm.mtp.head import MTPHead, rms_norm
from bonsai_vllm.mtp.io import Frozen, MTPInputError
from bonsai_vllm.ternary.reference import signed_block_hadamard



def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 maths on a GPU; on a CPU fp32 (bf16 matmuls and their backward are many times slower there)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass
class Sample:
    hidden: torch.Tensor     # [n, H], the last layer's output before the final norm
    token_ids: torch.Tensor  # [n] int64


def load_samples(folder: Path, hidden_size: int) -> list[Sample]:
    """Every `*.safetensors` of `folder` holding `hidden_states` [n, 1, H] (or [n, H]) and `token_ids` [n]."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise MTPInputError(f"{folder}: no hidden-state files (*.safetensors); run `bonsai-mtp-train extract`")
    out = []
    for f in files:
        d = load_file(str(f))
        if "hidden_states" not in d or "token_ids" not in d:
            raise MTPInputError(f"{f}: not a hidden-state file (needs hidden_states and token_ids)")
        h, ids = d["hidden_states"], d["token_ids"].long().reshape(-1)
        if h.dim() == 3:
            if h.shape[1] != 1:
                raise MTPInputError(f"{f}: {h.shape[1]} layers captured; extract only layer num_hidden_layers")
            h = h[:, 0]
        if h.shape[-1] != hidden_size:
            raise MTPInputError(f"{f}: hidden states of width {h.shape[-1]} but the model's hidden_size is "
                                f"{hidden_size}: they were extracted from another model")
        if h.shape[0] != ids.shape[0]:
            raise MTPInputError(f"{f}: {h.shape[0]} hidden states for {ids.shape[0]} tokens")
        if ids.shape[0] >= 3:
            out.append(Sample(hidden=h, token_ids=ids))
    if len(out) < 2:
        raise MTPInputError(f"{folder}: {len(out)} usable sequences (of 3 tokens or more); need at least 2 "
                            "(one held out)")
    return out


@dataclass
class TrainConfig:
    steps: int = 300
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch: int = 4           # sequences per step
    holdout: float = 0.2     # fraction of sequences held out
    seed: int = 0
    save_every: int = 50
    eval_every: int = 25


def split(n: int, holdout: float, seed: int) -> tuple[list[int], list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = max(1, min(n - 1, round(n * holdout)))
    return sorted(order[k:]), sorted(order[:k])


class Trainer:
    def __init__(self, frozen: Frozen, samples: list[Sample], cfg: TrainConfig, checkpoint: Path | None,
                 device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.compute = compute_dtype(self.device)
        self.frozen, self.samples, self.cfg, self.checkpoint = frozen, samples, cfg, checkpoint
        self.embed = frozen.embed.to(self.device)
        self.lm_head = frozen.lm_head.to(self.device, self.compute)
        self.final_norm = frozen.final_norm.to(self.device)
        self.train_ids, self.held_ids = split(len(samples), cfg.holdout, cfg.seed)
        self.head = MTPHead(frozen.shape, {n: t.float() for n, t in frozen.head.items()}, compute=self.compute)
        self.head.to(self.device)
        self.opt = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        self.history: list[dict] = []
        if checkpoint is not None and checkpoint.is_file():
            self._resume(checkpoint)

    # ------------------------------------------------------------------ maths
    def logits(self, s: Sample) -> torch.Tensor:
        """The head's logits for t_2..t_{n-1} of one sequence: [n-2, vocab] (float32)."""
        f, dev = self.frozen, self.device
        h = rms_norm(s.hidden[:-2].to(dev, self.compute), self.final_norm, f.shape.rms_norm_eps)
        e = self.embed[s.token_ids[1:-1].to(dev)].to(self.compute)
        pos = torch.arange(h.shape[0], device=dev)
        x = self.head(h, e, pos)
        if f.lm_head_signs is not None:
            x = signed_block_hadamard(x.float(), f.lm_head_signs.to(dev), f.hadamard_block).to(x.dtype)
        return (x @ self.lm_head.t()).float()

    def loss(self, s: Sample) -> torch.Tensor:
        return F.cross_entropy(self.logits(s), s.token_ids[2:].to(self.device))

    @torch.no_grad()
    def evaluate(self, ids: list[int] | None = None) -> tuple[float, float]:
        """(mean loss, top-1 agreement with t_{i+2}) over the held-out sequences."""
        total, hits, n = 0.0, 0, 0
        for i in self.held_ids if ids is None else ids:
            s = self.samples[i]
            lg = self.logits(s)
            target = s.token_ids[2:].to(self.device)
            total += F.cross_entropy(lg, target, reduction="sum").item()
            hits += int((lg.argmax(-1) == target).sum())
            n += target.numel()
        return total / n, hits / n

    # ------------------------------------------------------------------ loop
    def run(self, progress: bool = True) -> dict:
        cfg = self.cfg
        bar = tqdm(total=cfg.steps, initial=self.step, desc="mtp", disable=not progress, dynamic_ncols=True)
        held = self.evaluate()
        if not self.history:
            self.history.append({"step": self.step, "held_loss": held[0], "held_acceptance": held[1]})
        while self.step < cfg.steps:
            # the batch depends only on (seed, step): a resumed run draws what an uninterrupted one would
            rng = random.Random(cfg.seed * 1_000_003 + self.step)
            batch = [self.samples[rng.choice(self.train_ids)] for _ in range(cfg.batch)]
            loss = sum(self.loss(s) for s in batch) / len(batch)
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"step {self.step}: loss is {loss.item()}; lower --lr")
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
            self.opt.step()
            self.step += 1
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                held = self.evaluate()
                self.history.append({"step": self.step, "loss": loss.item(), "held_loss": held[0],
                                     "held_acceptance": held[1]})
            bar.set_postfix(loss=f"{loss.item():.3f}", held_acc=f"{held[1]:.1%}")
            bar.update(1)
            if self.checkpoint is not None and (self.step % cfg.save_every == 0 or self.step == cfg.steps):
                self.save(self.checkpoint)
        bar.close()
        return {"step": self.step, "held_loss": held[0], "held_acceptance": held[1], "history": self.history}

    # ------------------------------------------------------------------ checkpoints
    def _signature(self) -> dict:
        return {"names": self.head.names, "shapes": [list(p.shape) for p in self.head.params],
                "samples": len(self.samples), "held": self.held_ids,
                **{k: v for k, v in asdict(self.cfg).items() if k not in ("steps", "save_every", "eval_every")}}

    def save(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"signature": self._signature(), "step": self.step, "history": self.history,
                    "head": {n: p.detach() for n, p in zip(self.head.names, self.head.params)},
                    "optimizer": self.opt.state_dict()}, tmp)
        os.replace(tmp, path)

    def _resume(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["signature"] != self._signature():
            raise MTPInputError(f"{path}: a checkpoint of another run (other data, split or settings); "
                                "remove it or pass another --checkpoint")
        with torch.no_grad():
            for n, p in zip(self.head.names, self.head.params):
                p.copy_(state["head"][n].to(p.device))
        self.opt.load_state_dict(state["optimizer"])
        self.step, self.history = int(state["step"]), list(state["history"])

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: t.cpu() for n, t in self.head.state().items()}


def wait_for_file(path: Path, timeout: float = 120.0) -> None:
    """vLLM's connector writes the file after answering and holds an exclusive lock on `<path>.lock` while
    it does: take a shared lock (sleeps until the write is done), as upstream's `load_hidden_states` does."""
    import fcntl
    import time

    lock = Path(str(path) + ".lock")
    deadline = time.monotonic() + timeout
    while not (lock.exists() or path.exists()):
        if time.monotonic() > deadline:
            raise MTPInputError(f"{path}: not written within {timeout:.0f} s")
        time.sleep(0.05)
    if lock.exists():
        with lock.open() as f:
            fcntl.flock(f, fcntl.LOCK_SH)
    if not path.exists():
        raise MTPInputError(f"{path}: the extraction server released the lock without writing the file")
