"""The Qwen3.5 MTP head in plain torch, with vLLM's maths (`vllm/model_executor/models/qwen3_5_mtp.py`).

For a sequence's positions i = 0..n-2, the drafter takes the target model's hidden state h_i (the main
model's output *after* its final norm: what vLLM hands the drafter; the extracted layer-`num_hidden_layers`
state is before that norm) and the embedding of the next token t_{i+1}, at position i, and predicts
t_{i+2}:

    x = fc(cat(pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)))
    x = decoder_layer(x)        # one full-attention Qwen3.5 layer, causal over the sequence
    logits = lm_head(norm(x))   # the main model's own (frozen) LM head

Norms are Qwen3.5's RMSNorm, scaling by (1 + w). The attention has an output gate (q_proj emits query
and gate per head), per-head q/k norms and partial rotary embedding (the first rotary_dim of each head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class HeadShape:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    vocab_size: int

    @classmethod
    def from_config(cls, config: dict) -> "HeadShape":
        """From a model's config.json (a multimodal config's `text_config`, or a text config)."""
        text = config.get("text_config", config)
        rope = text.get("rope_parameters") or {}
        return cls(hidden_size=text["hidden_size"], num_attention_heads=text["num_attention_heads"],
                   num_key_value_heads=text["num_key_value_heads"],
                   head_dim=text.get("head_dim", text["hidden_size"] // text["num_attention_heads"]),
                   intermediate_size=text["intermediate_size"], rms_norm_eps=text.get("rms_norm_eps", 1e-6),
                   rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
                   partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                        text.get("partial_rotary_factor", 1.0))),
                   vocab_size=text["vocab_size"])

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: computed in fp32, scaled by (1 + w), returned in x's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return out.to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, shape: HeadShape) -> torch.Tensor:
    """Neox-style rotary embedding on the first rotary_dim of each head. x: [..., seq, heads, head_dim]."""
    rot = shape.rotary_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32, device=x.device) / rot))
    freqs = positions.float()[..., None] * inv_freq  # [..., seq, rot/2]
    cos, sin = freqs.cos()[..., None, :], freqs.sin()[..., None, :]  # broadcast over heads
    xr, xp = x[..., :rot].float(), x[..., rot:]
    a, b = xr[..., : rot // 2], xr[..., rot // 2:]
    out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)
    return torch.cat([out, xp], dim=-1)


class MTPHead(nn.Module):
    """The trainable `mtp.*` tensors, under names relative to `mtp.` (e.g. `layers.0.self_attn.q_proj.weight`)."""

    def __init__(self, shape: HeadShape, tensors: dict[str, torch.Tensor], compute: torch.dtype | None = None):
        super().__init__()
        self.shape = shape
        self.compute = compute  # None: the parameters' own dtype; else weights are cast for the maths
        self.names = sorted(tensors)
        # nn.ParameterDict forbids dots in keys: keep the checkpoint's names in a side table.
        self.params = nn.ParameterList([nn.Parameter(tensors[n].clone()) for n in self.names])
        self._index = {n: i for i, n in enumerate(self.names)}

    def p(self, name: str) -> torch.Tensor:
        w = self.params[self._index[name]]
        return w if self.compute is None else w.to(self.compute)

    def state(self) -> dict[str, torch.Tensor]:
        return {n: self.params[i].detach() for i, n in enumerate(self.names)}

    def attention(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        s, p = self.shape, "layers.0.self_attn."
        *lead, n, _ = x.shape
        qg = F.linear(x, self.p(p + "q_proj.weight")).view(*lead, n, s.num_attention_heads, 2 * s.head_dim)
        q, gate = qg[..., : s.head_dim], qg[..., s.head_dim:]
        k = F.linear(x, self.p(p + "k_proj.weight")).view(*lead, n, s.num_key_value_heads, s.head_dim)
        v = F.linear(x, self.p(p + "v_proj.weight")).view(*lead, n, s.num_key_value_heads, s.head_dim)
        q = rotate(rms_norm(q, self.p(p + "q_norm.weight"), s.rms_norm_eps), positions, s)
        k = rotate(rms_norm(k, self.p(p + "k_norm.weight"), s.rms_norm_eps), positions, s)
        group = s.num_attention_heads // s.num_key_value_heads
        k, v = k.repeat_interleave(group, dim=-2), v.repeat_interleave(group, dim=-2)
        out = F.scaled_dot_product_attention(q.transpose(-2, -3), k.transpose(-2, -3), v.transpose(-2, -3),
                                             is_causal=True, scale=s.head_dim ** -0.5).transpose(-2, -3)
        out = out * torch.sigmoid(gate)
        return F.linear(out.reshape(*lead, n, -1), self.p(p + "o_proj.weight"))

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden: the target's normed last hidden states [..., n, H]; next_embeds: embed(t_{i+1}) [..., n, H];
        positions [..., n]. Returns the head's final normed state [..., n, H] (apply the LM head for logits)."""
        eps = self.shape.rms_norm_eps
        e = rms_norm(next_embeds, self.p("pre_fc_norm_embedding.weight"), eps)
        h = rms_norm(hidden, self.p("pre_fc_norm_hidden.weight"), eps)
        x = F.linear(torch.cat([e, h], dim=-1), self.p("fc.weight"))
        r = x
        x = r + self.attention(rms_norm(x, self.p("layers.0.input_layernorm.weight"), eps), positions)
        y = rms_norm(x, self.p("layers.0.post_attention_layernorm.weight"), eps)
        m = "layers.0.mlp."
        y = F.linear(F.silu(F.linear(y, self.p(m + "gate_proj.weight"))) * F.linear(y, self.p(m + "up_proj.weight")),
                     self.p(m + "down_proj.weight"))
        return rms_norm(x + y, self.p("norm.weight"), eps)
