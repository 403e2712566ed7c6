"""`bonsai-tiny`: write a small random Qwen3.5-hybrid checkpoint that vLLM serves like the real 27B.

The tests cannot download the 27B, so they serve a model that has its *shapes where they matter*:
- both layer kinds (Gated DeltaNet and full attention, `[linear, linear, linear, full]`),
- GDN head dims 128 and attention head_dim 256 (vLLM-CPU's GDN kernel accepts only 128),
- every input width a multiple of the 1024 Hadamard block (hidden 1024, 4 query heads × 256,
  8 GDN value heads × 128),
- an intermediate size (3072) whose TP=2 half (1536) cuts a Hadamard block, as 17408 → 8704 does.

It comes with a byte-level BPE tokenizer trained on `corpus.py` and a Qwen-style chat template, and is
deterministic for a given `--seed`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from bonsai_vllm.core.corpus import corpus

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>"]

# Qwen-style ChatML template, written for these tests: system/user/assistant/tool turns and the generation
# prompt. Enough for vLLM's chat endpoint; the real model ships its own template.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    """Sizes of the tiny model. Defaults satisfy every constraint in the module docstring."""

    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 256
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    vocab_target: int = 2048  # tokenizer size asked of the BPE trainer

    def check(self, block: int = 1024) -> None:
        widths = {
            "hidden_size": self.hidden_size,
            "num_attention_heads * head_dim": self.num_attention_heads * self.head_dim,
            "linear_num_value_heads * linear_value_head_dim":
                self.linear_num_value_heads * self.linear_value_head_dim,
            "intermediate_size": self.intermediate_size,
        }
        for name, width in widths.items():
            if width % block:
                raise ValueError(f"{name} = {width} is not a multiple of the Hadamard block {block}; "
                                 "ternary layers need every input width to be one")


def train_tokenizer(out_dir: Path, vocab_target: int, seed: int):
    """Train a byte-level BPE on the generated corpus; save it with a chat template. Returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_target, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def make_config(shape: TinyShape, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        max_position_embeddings=4096,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    config.dtype = "bfloat16"
    return config


def train_briefly(model, tokenizer, steps: int, seed: int, batch: int = 8, length: int = 64,
                  lr: float = 3e-3) -> float:
    """A few AdamW steps on the corpus so that predictions on its fixed sequences become decisive.

    A random model's top logits are nearly tied, so any rounding flips its greedy tokens; tests that want
    to compare greedy text need a model that has memorised something (counting, weekdays). Returns the
    last loss.
    """
    from tqdm import tqdm

    ids = torch.tensor(tokenizer("\n".join(corpus(seed)))["input_ids"])  # [corpus tokens]
    gen = torch.Generator().manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = float("nan")
    for _ in tqdm(range(steps), desc="training tiny model", unit="step", disable=None):
        starts = torch.randint(0, len(ids) - length - 1, (batch,), generator=gen)
        x = torch.stack([ids[i:i + length] for i in starts.tolist()])  # [batch, length]
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        loss = out.loss.item()
    model.eval()
    return loss


def write_tiny(out_dir: Path, seed: int = 0, shape: TinyShape = TinyShape(), train_steps: int = 0) -> Path:
    """Write tokenizer, config and bf16 weights (random, or briefly trained) to `out_dir`. Returns it."""
    from transformers import Qwen3_5ForCausalLM

    shape.check()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out_dir, shape.vocab_target, seed)
    # Round the embedding up to a multiple of 256 as real checkpoints pad their vocabulary.
    vocab_size = -(-len(tokenizer) // 256) * 256
    config = make_config(shape, vocab_size, tokenizer.eos_token_id, tokenizer.pad_token_id)

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)  # float32 while training, bf16 on disk like the real checkpoint
    if train_steps:
        train_briefly(model, tokenizer, train_steps, seed)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
         "do_sample": False}, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bonsai-tiny",
        description="Write a tiny random Qwen3.5-hybrid checkpoint (GDN + full attention, the 27B's head "
                    "dims, Hadamard-friendly widths) for tests and demos.")
    parser.add_argument("out_dir", type=Path, help="directory to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="random seed; same seed, same files (default 0)")
    parser.add_argument("--layers", type=int, default=TinyShape.num_hidden_layers,
                        help="number of layers, a multiple of 4 for the [GDN×3, attention] pattern (default 4)")
    parser.add_argument("--train-steps", type=int, default=0,
                        help="train this many AdamW steps on the built-in corpus first, so greedy predictions "
                             "on its fixed sequences are decisive (about 1.5 s a step on 2 CPU cores; default 0)")
    parser.add_argument("--ternary", action="store_true",
                        help="then convert it in place to the vLLM prism_ternary format (bonsai-convert, "
                             "sign vectors seeded by --seed): OUT_DIR is replaced by the ternary checkpoint")
    args = parser.parse_args(argv)
    if args.layers < 4 or args.layers % 4:
        parser.error(f"--layers must be a positive multiple of 4, got {args.layers}")
    out = write_tiny(args.out_dir, seed=args.seed, shape=TinyShape(num_hidden_layers=args.layers),
                     train_steps=args.train_steps)
    if args.ternary:
        from bonsai_vllm.core.convert import convert_to_ternary

        convert_to_ternary(out, out, seed=args.seed, overwrite=True)
    print(f"wrote tiny Qwen3.5-hybrid {'prism_ternary ' if args.ternary else ''}model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
