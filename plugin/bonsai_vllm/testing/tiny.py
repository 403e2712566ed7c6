"""`bonsai-tiny`: write a small random Qwen3.5-hybrid checkpoint that vLLM serves like the real 27B.

The tests cannot download the 27B, so they serve a model that has its *shapes where they matter*:
- both layer kinds (Gated DeltaNet and full attention, `[linear, linear, linear, full]`),
- GDN head dims 128 and attention head_dim 256 (vLLM-CPU's GDN kernel accepts only 128),
- every input width a multiple of the 1024 Hadamard block (hidden 1024, 4 query heads × 256,
  8 GDN value heads × 128),
- an intermediate size (3072) whose TP=2 half (1536) cuts a Hadamard block, as 17408 → 8704 does.

It comes with a byte-level BPE tokenizer trained on `corpus.py` and a Qwen-style chat template, and is
deterministic for a given `--seed`.

Two optional parts make it look like the published multimodal checkpoint (model-fetch tests need both):
- `--mtp`: a one-layer multi-token-prediction head under `mtp.*` (bf16, HF names: `mtp.fc`,
  `mtp.pre_fc_norm_{embedding,hidden}`, `mtp.layers.0.*` a full-attention layer, `mtp.norm`), the drafter
  vLLM's `Qwen3_5MTP` loads;
- `--vision`: a tiny vision tower (depth 2, hidden 128; `TinyVision`) under `model.visual.*`, the language
  model then under `model.language_model.*`, a multimodal `qwen3_5` config (`Qwen3_5ForConditionalGeneration`
  with `text_config` / `vision_config`), the vision special tokens and an image processor config. The vision
  tower is never ternary, so its widths need not be multiples of 1024.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from bonsai_vllm.testing.corpus import corpus

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>"]
# Added only with a vision tower (appended, so the ids of the text-only tokenizer do not move).
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

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
# The same template with image parts rendered as Qwen's vision placeholder (vLLM expands the pad token
# into one token per merged patch); only the multimodal tiny model ships it.
VISION_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}",
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- endif %}")


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


@dataclass(frozen=True)
class TinyVision:
    """Sizes of the tiny vision tower (Qwen3.5's ViT: 27 blocks of 1152 in the real model)."""

    depth: int = 2
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 2
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 256  # a 16 × 16 grid of learned positions


def train_tokenizer(out_dir: Path, vocab_target: int, seed: int, *, vision: bool = False):
    """Train a byte-level BPE on the generated corpus; save it with a chat template. Returns the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIAL_TOKENS + (VISION_TOKENS if vision else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_target, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
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


def make_mtp_tensors(config, seed: int) -> dict[str, torch.Tensor]:
    """A random one-layer MTP head for a text config, bf16, under the checkpoint's `mtp.*` names.

    Layout of Qwen3.5's drafter (vLLM `Qwen3_5MultiTokenPredictor`): `fc` [hidden, 2·hidden] over the
    concatenated normed embedding and hidden state, a full-attention decoder layer, a final norm.
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    full = config.layer_types.index("full_attention")  # the layer index only picks the layer kind
    torch.manual_seed(seed)
    layer = Qwen3_5DecoderLayer(config, layer_idx=full)
    hidden = config.hidden_size
    tensors = {f"mtp.layers.0.{k}": v for k, v in layer.state_dict().items()}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norm = Qwen3_5RMSNorm(hidden, eps=config.rms_norm_eps)
        # Norms initialise to zero (Qwen3.5 scales by 1 + w); a little noise tells two heads apart.
        tensors[f"mtp.{name}.weight"] = norm.weight.detach() + 0.01 * torch.randn(hidden)
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) * config.initializer_range
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sorted(tensors.items())}


def make_vision_tensors(vision: TinyVision, out_hidden_size: int, seed: int) -> tuple[object, dict[str, torch.Tensor]]:
    """A random vision tower: (vision config, its bf16 tensors under `model.visual.*`)."""
    from transformers import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    vcfg = Qwen3_5VisionConfig(depth=vision.depth, hidden_size=vision.hidden_size,
                               intermediate_size=vision.intermediate_size, num_heads=vision.num_heads,
                               patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                               spatial_merge_size=vision.spatial_merge_size, out_hidden_size=out_hidden_size,
                               num_position_embeddings=vision.num_position_embeddings)
    torch.manual_seed(seed)
    tower = Qwen3_5VisionModel(vcfg)
    tensors = {f"model.visual.{k}": v.detach().to(torch.bfloat16).contiguous()
               for k, v in tower.state_dict().items()}
    return vcfg, tensors


def _image_processor_config(vision: TinyVision) -> dict:
    """Qwen2-VL image processor settings for tiny images (a few hundred pixels a side at most)."""
    return {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
            "patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
            "merge_size": vision.spatial_merge_size, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "do_resize": True,
            # Pixel-area bounds: 32×32 .. 128×128, so an image costs 1 .. 16 merged tokens.
            "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128}}


def write_tiny(out_dir: Path, seed: int = 0, shape: TinyShape = TinyShape(), train_steps: int = 0, *,
               mtp: bool = False, vision: TinyVision | None = None) -> Path:
    """Write tokenizer, config and bf16 weights (random, or briefly trained) to `out_dir`. Returns it.

    `mtp` adds a random MTP head (`mtp.*`); `vision` adds a random vision tower and makes the checkpoint
    the multimodal `qwen3_5` layout (see the module docstring). Both are drawn after the language model,
    from seeds derived from `seed` (the vision tokens do change the tokenizer, hence the vocabulary).
    """
    from transformers import Qwen3_5ForCausalLM

    shape.check()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out_dir, shape.vocab_target, seed, vision=vision is not None)
    # Round the embedding up to a multiple of 256 as real checkpoints pad their vocabulary.
    vocab_size = -(-len(tokenizer) // 256) * 256
    config = make_config(shape, vocab_size, tokenizer.eos_token_id, tokenizer.pad_token_id)

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)  # float32 while training, bf16 on disk like the real checkpoint
    if train_steps:
        train_briefly(model, tokenizer, train_steps, seed)
    model = model.to(torch.bfloat16)
    if mtp or vision is not None:
        _save_with_parts(out_dir, model, config, tokenizer, seed, mtp=mtp, vision=vision)
    else:
        model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
         "do_sample": False}, indent=2) + "\n")
    return out_dir


def _save_with_parts(out_dir: Path, model, config, tokenizer, seed: int, *, mtp: bool,
                     vision: TinyVision | None) -> None:
    """Save the language model plus an MTP head and/or a vision tower as one safetensors file."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    text = config.to_diff_dict()  # what save_pretrained writes: only fields that differ from defaults
    if mtp:
        text["mtp_num_hidden_layers"] = 1
        tensors.update(make_mtp_tensors(config, seed + 1))
    if vision is None:
        full = text
    else:
        from transformers import Qwen3_5Config

        # The multimodal layout: the language model moves under model.language_model.; lm_head stays.
        tensors = {(f"model.language_model.{k.removeprefix('model.')}" if k.startswith("model.") else k): v
                   for k, v in tensors.items()}
        vcfg, vision_tensors = make_vision_tensors(vision, config.hidden_size, seed + 2)
        tensors.update(vision_tensors)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
        text_only = {k: v for k, v in config.to_dict().items() if k != "architectures"}
        mm = Qwen3_5Config(text_config=text_only, vision_config=vcfg.to_dict(),
                           image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                           vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
        full = mm.to_diff_dict()  # what save_pretrained writes: only fields that differ from defaults
        full["architectures"] = ["Qwen3_5ForConditionalGeneration"]
        full["text_config"].pop("architectures", None)
        if mtp:
            full["text_config"]["mtp_num_hidden_layers"] = 1
        (out_dir / "preprocessor_config.json").write_text(
            json.dumps(_image_processor_config(vision), indent=2) + "\n")
    full["dtype"] = "bfloat16"
    save_file(dict(sorted(tensors.items())), out_dir / "model.safetensors", metadata={"format": "pt"})
    # safetensors creates the file 0600; a served model must be readable by the server's user.
    (out_dir / "model.safetensors").chmod(0o644)
    (out_dir / "config.json").write_text(json.dumps(full, indent=2, sort_keys=True) + "\n")


# What the scripted model says (write_scripted): a reasoning part, then an answer, in the corpus's words so
# that the tokenizer has them as few, distinct tokens.
SCRIPT_REASONING = "After Monday comes Tuesday, so the month after January is February"
SCRIPT_ANSWER = "Counting: one two three four five six seven eight nine ten eleven twelve."


def write_scripted(src: Path, out: Path, reasoning: str = SCRIPT_REASONING, answer: str = SCRIPT_ANSWER,
                   scale: float = 1.0) -> list[int]:
    """Copy tiny checkpoint `src` to `out` with weights that make it reply, to any prompt, with
    `<think>reasoning</think>answer<|im_end|>`, token for token: a stand-in for the real model's answers
    that goes through vLLM's real chat template, reasoning parser and streaming (the web UI tests).

    How: every layer's output projection (attention o_proj, GDN out_proj, MLP down_proj) is zero, so the
    residual stream at a position is just that token's embedding; the embeddings are random unit vectors,
    and lm_head row b holds embedding a for each step a -> b of the reply (started by the last token of the
    chat template's generation prompt). Each position's argmax is then the reply's next token, by a margin of
    ~√hidden logits, whatever came before; the vision tower (if any) keeps its own weights. Every token of
    the chain must be distinct (checked). Returns the chain's token ids."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    src, out = Path(src), Path(out)
    shutil.copytree(src, out, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src)
    prompt = tok.apply_chat_template([{"role": "user", "content": "?"}], add_generation_prompt=True, tokenize=False)
    chain = [tok.encode(prompt)[-1], tok.convert_tokens_to_ids("<think>"), *tok.encode(reasoning),
             tok.convert_tokens_to_ids("</think>"), *tok.encode(answer), tok.eos_token_id]
    if len(set(chain)) != len(chain):
        dup = sorted({tok.decode([t]) for t in chain if chain.count(t) > 1})
        raise ValueError(f"write_scripted: the reply repeats the tokens {dup}; every token may occur once")
    path = out / "model.safetensors"
    tensors = load_file(path)
    lm = "model.language_model." if any(k.startswith("model.language_model.") for k in tensors) else "model."
    embed = tensors[f"{lm}embed_tokens.weight"]
    vocab, hidden = embed.shape
    g = torch.Generator().manual_seed(0)
    e = torch.randn(vocab, hidden, generator=g)
    e = e / e.norm(dim=-1, keepdim=True)  # unit rows: after the final RMSNorm each has norm √hidden
    head = torch.zeros(vocab, hidden)
    for a, b in zip(chain, chain[1:]):
        head[b] += scale * e[a]
    for name, t in tensors.items():
        if name.startswith(lm + "layers.") and name.endswith(("o_proj.weight", "out_proj.weight",
                                                                 "down_proj.weight")):
            tensors[name] = torch.zeros_like(t)
    tensors[f"{lm}embed_tokens.weight"] = e.to(embed.dtype)
    tensors["lm_head.weight"] = head.to(tensors["lm_head.weight"].dtype)
    tensors[f"{lm}norm.weight"] = torch.zeros_like(tensors[f"{lm}norm.weight"])  # zero-centred: scale 1
    save_file(tensors, path, metadata={"format": "pt"})
    path.chmod(0o644)
    # Web UIs send long system prompts (Open WebUI: ~25 kB with its tools); attention contributes nothing
    # here, so any context length answers the same.
    cfg = json.loads((out / "config.json").read_text())
    (cfg.get("text_config") or cfg)["max_position_embeddings"] = 65536
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return chain


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
    parser.add_argument("--mtp", action="store_true",
                        help="add a random one-layer MTP head (mtp.*, bf16) like the published checkpoint's")
    parser.add_argument("--vision", action="store_true",
                        help="add a tiny vision tower (depth 2, hidden 128) and write the multimodal qwen3_5 "
                             "layout: model.language_model.* / model.visual.*, text_config + vision_config, "
                             "vision tokens and an image processor config")
    args = parser.parse_args(argv)
    if args.layers < 4 or args.layers % 4:
        parser.error(f"--layers must be a positive multiple of 4, got {args.layers}")
    # Pass the optional parts only when asked, so callers that stand in for write_tiny need not know them.
    extra = {**({"train_steps": args.train_steps} if args.train_steps else {}),
             **({"mtp": True} if args.mtp else {}), **({"vision": TinyVision()} if args.vision else {})}
    out = write_tiny(args.out_dir, seed=args.seed, shape=TinyShape(num_hidden_layers=args.layers), **extra)
    if args.ternary:
        from bonsai_vllm.checkpoint.convert import convert_to_ternary

        convert_to_ternary(out, out, seed=args.seed, overwrite=True)
    print(f"wrote tiny Qwen3.5-hybrid {'prism_ternary ' if args.ternary else ''}model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
