"""The torch MTP head (bonsai_vllm.mtp.head) against an independent formulation: transformers' own
Qwen3.5 decoder layer, norms and rotary embedding with the same weights, written as vLLM's
`Qwen3_5MultiTokenPredictor.forward` composes them (norm the embedding and the hidden state, fc over
their concatenation, one full-attention layer, final norm)."""

from __future__ import annotations

import pytest
import torch

from bonsai_vllm.mtp.head import HeadShape, MTPHead
from bonsai_vllm.testing.tiny import TinyShape, make_config, make_mtp_tensors

tm = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def _config():
    config = make_config(TinyShape(), vocab_size=64, eos_id=0, pad_id=0)
    config._attn_implementation = "eager"
    return config


def _reference(config, tensors, hidden, embeds, positions):
    layer = tm.Qwen3_5DecoderLayer(config, layer_idx=config.layer_types.index("full_attention")).float()
    layer.load_state_dict({k.removeprefix("mtp.layers.0."): v.float() for k, v in tensors.items()
                           if k.startswith("mtp.layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = tm.Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data = tensors[f"mtp.{name}.weight"].float()
    rope = tm.Qwen3_5TextRotaryEmbedding(config)
    x = torch.cat([norms["pre_fc_norm_embedding"](embeds), norms["pre_fc_norm_hidden"](hidden)], -1)
    x = x @ tensors["mtp.fc.weight"].float().t()
    # text-only positions: the three M-RoPE sections all see the same position
    cos_sin = rope(x, positions[None].expand(3, 1, -1))
    n = x.shape[1]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    out = layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions[None])
    out = out[0] if isinstance(out, tuple) else out
    return norms["norm"](out)


def test_head_matches_transformers_layer():
    config = _config()
    tensors = make_mtp_tensors(config, seed=3)
    # make the attention and MLP matter: the random init is small next to the residual
    tensors = {k: (v.float() * (4.0 if k.endswith("proj.weight") else 1.0)) for k, v in tensors.items()}
    torch.manual_seed(0)
    n, hid = 12, config.hidden_size
    hidden, embeds = torch.randn(1, n, hid), torch.randn(1, n, hid)
    positions = torch.arange(5, 5 + n)
    ref = _reference(config, tensors, hidden, embeds, positions)
    head = MTPHead(HeadShape.from_config(config.to_dict()), {k.removeprefix("mtp."): v for k, v in tensors.items()})
    got = head(hidden, embeds, positions[None])
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err < 1e-4 * ref.abs().max().item() + 1e-5, err
    # the check can fail: wrong relative positions (rotary; a uniform shift is invisible to RoPE) move the
    # output far past that
    off = head(hidden, embeds, positions[None] * 3)
    assert (off - ref).abs().max().item() > 100 * max(err, 1e-6)
