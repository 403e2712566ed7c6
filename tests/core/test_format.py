"""ternary/format.py: bit layout, sign encoding, quantization_config validation, tensor checks.

The expected values are written by hand from the spec (docs/format.md), not computed by the code under test.
"""

from __future__ import annotations

import pytest
import torch

from bonsai_vllm.ternary.format import (
    TERNARY_MODULES,
    PrismTernaryConfig,
    check_module_tensors,
    count_unused_codes,
    decode_signs,
    encode_signs,
    is_ternary_module,
    pack_ternary,
    unpack_ternary,
)

# --------------------------------------------------------------------------------------- bit layout

# code = value + 1 (0b00 = -1, 0b01 = 0, 0b10 = +1), code i at bits 2i. Worked out by hand:
#   all zeros            -> every field 0b01                  = 0x55555555
#   [-1, 0, +1, -1, 0...]-> low byte 0b00_10_01_00 = 0x24     = 0x55555524
#   all -1               -> every field 0b00                  = 0
#   +1 at index 15 only  -> 0x55555555 + (1 << 30) = 0x95555555, bit 31 set: as int32 -1789569707
#   all +1               -> 0xAAAAAAAA, as int32 -1431655766
HAND_VECTORS = [
    ([0] * 16, 0x55555555),
    ([-1, 0, 1, -1] + [0] * 12, 1431655716),
    ([-1] * 16, 0),
    ([0] * 15 + [1], -1789569707),
    ([1] * 16, -1431655766),
]


@pytest.mark.parametrize("values, word", HAND_VECTORS)
def test_pack_bit_layout_hand_vectors(values, word):
    packed = pack_ternary(torch.tensor([values], dtype=torch.int8))
    assert packed.dtype == torch.int32 and packed.shape == (1, 1)
    assert packed.item() == word
    assert unpack_ternary(torch.tensor([[word]], dtype=torch.int32)).tolist() == [values]


def test_pack_two_words_in_order():
    # Word 0 holds inputs 0..15, word 1 inputs 16..31.
    values = torch.tensor([[-1] * 16 + [1] * 16], dtype=torch.int8)
    assert pack_ternary(values).tolist() == [[0, -1431655766]]


def test_pack_unpack_round_trip_any_leading_shape():
    gen = torch.Generator().manual_seed(1)
    values = torch.randint(-1, 2, (3, 5, 64), generator=gen).to(torch.int8)
    packed = pack_ternary(values)
    assert packed.shape == (3, 5, 4) and packed.dtype == torch.int32
    out = unpack_ternary(packed)
    assert out.dtype == torch.int8 and torch.equal(out, values)


def test_pack_rejects_bad_values_width_and_dtype():
    with pytest.raises(ValueError, match=r"\{-1, 0, \+1\}"):
        pack_ternary(torch.tensor([[2] + [0] * 15], dtype=torch.int8))
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_ternary(torch.zeros(1, 24, dtype=torch.int8))
    with pytest.raises(ValueError, match="integer tensor"):
        pack_ternary(torch.zeros(1, 16))


def test_unused_code_is_counted():
    # 0b0111: field 0 = 0b11 (unused), field 1 = 0b01. All bits set: all 16 fields are 0b11.
    assert count_unused_codes(torch.tensor([0b0111], dtype=torch.int32)) == 1
    assert count_unused_codes(torch.tensor([-1], dtype=torch.int32)) == 16
    # 0xC0000000 as int32: only field 15 = 0b11 (checks the arithmetic shift at the sign bit).
    assert count_unused_codes(torch.tensor([-1073741824], dtype=torch.int32)) == 1
    assert count_unused_codes(torch.tensor([0x55555555, 0, -1431655766], dtype=torch.int32)) == 0


# -------------------------------------------------------------------------------------------- signs

# Signs [+1,-1,+1,+1,+1,+1,+1,-1, -1 × 8]: bits (sign < 0) 01000001 11111111 = bytes 0x41 0xFF = "Qf8=".
HAND_SIGNS = [1.0, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0] + [-1.0] * 8


def test_decode_signs_pinned_base64():
    assert decode_signs("Qf8=", 16).tolist() == HAND_SIGNS
    assert decode_signs("Qf8=", 16).dtype == torch.float32


def test_encode_signs_pinned_base64():
    assert encode_signs(torch.tensor(HAND_SIGNS)) == "Qf8="


def test_signs_padding_bits_of_a_short_width():
    # Width 12 packs into 2 bytes; the last 4 bits are padding and must be zero: 0x41 0xF0 = "QfA=".
    assert decode_signs("QfA=", 12).tolist() == HAND_SIGNS[:12]
    assert encode_signs(torch.tensor(HAND_SIGNS[:12])) == "QfA="
    with pytest.raises(ValueError, match="padding"):
        decode_signs("Qf8=", 12)


def test_signs_round_trip_real_width():
    gen = torch.Generator().manual_seed(0)
    s = torch.randint(0, 2, (5120,), generator=gen).float() * 2 - 1
    assert torch.equal(decode_signs(encode_signs(s), 5120), s)


@pytest.mark.parametrize("b64, width, match", [
    ("Qf8=", 24, "expected 3"),       # too short for the width
    ("Qf8=", 8, "expected 1"),        # a wider vector's signs
    ("Qf8", 16, "not valid base64"),
])
def test_decode_signs_errors(b64, width, match):
    with pytest.raises(ValueError, match=match):
        decode_signs(b64, width)


def test_encode_signs_rejects_non_signs():
    with pytest.raises(ValueError, match=r"\+1 and -1"):
        encode_signs(torch.tensor([1.0, 0.0]))


# ------------------------------------------------------------------------------------------- config


def _config_dict(**overrides) -> dict:
    d = {"quant_method": "prism_ternary", "bits": 2, "group_size": 128, "hadamard_block": 1024,
         "signs": {"1024": encode_signs(torch.ones(1024)), "16": "Qf8="}}
    d.update(overrides)
    return d


def test_config_from_dict_to_dict_round_trip():
    cfg = PrismTernaryConfig.from_dict(_config_dict())
    assert (cfg.bits, cfg.group_size, cfg.hadamard_block) == (2, 128, 1024)
    assert set(cfg.signs) == {16, 1024}
    assert cfg.sign_vector(16).tolist() == HAND_SIGNS
    assert torch.equal(cfg.sign_vector(1024), torch.ones(1024))
    d = cfg.to_dict()
    assert d == _config_dict()
    assert list(d["signs"]) == ["16", "1024"]  # written in width order


@pytest.mark.parametrize("overrides, match", [
    ({"bits": 3}, "bits = 3"),
    ({"group_size": 64}, "group_size = 64"),
    ({"group_size": 256}, "group_size = 256"),
    ({"hadamard_block": 768}, "hadamard_block = 768"),   # not a power of two
    ({"hadamard_block": 64}, "hadamard_block = 64"),     # smaller than a group
    ({"quant_method": "awq"}, "quant_method = 'awq'"),
    ({"bits": "2"}, "'bits' must be an integer"),
    ({"signs": {"five": "Qf8="}}, "'five'"),
    ({"signs": {}}, "'signs'"),
])
def test_config_rejects_unsupported_layout(overrides, match):
    with pytest.raises(ValueError, match=match):
        PrismTernaryConfig.from_dict(_config_dict(**overrides))


def test_config_missing_key_is_named():
    d = _config_dict()
    del d["group_size"]
    with pytest.raises(ValueError, match="missing 'group_size'"):
        PrismTernaryConfig.from_dict(d)


def test_config_bad_sign_string_fails_at_load():
    with pytest.raises(ValueError, match="width 1024"):
        PrismTernaryConfig.from_dict(_config_dict(signs={"1024": "Qf8="}))


def test_config_hadamard_block_other_power_of_two_accepted():
    assert PrismTernaryConfig.from_dict(_config_dict(hadamard_block=512)).hadamard_block == 512


def test_sign_vector_missing_width_names_widths():
    cfg = PrismTernaryConfig.from_dict(_config_dict())
    with pytest.raises(ValueError, match=r"width 5120.*\[16, 1024\]"):
        cfg.sign_vector(5120)


# ------------------------------------------------------------------------------------ module tensors


def _cfg() -> PrismTernaryConfig:
    return PrismTernaryConfig.from_dict(_config_dict())


def test_check_module_tensors_accepts_the_format():
    w = torch.zeros(8, 2048 // 16, dtype=torch.int32)
    s = torch.zeros(8, 2048 // 128, dtype=torch.float16)
    check_module_tensors("m.down_proj", w, s, 8, 2048, _cfg())
    # A row-parallel rank's half of a 3072-wide input (1536: cuts a 1024 block, like 17408 -> 8704).
    check_module_tensors("m.down_proj", w[:, :96], s[:, :12], 8, 3072, _cfg(), in_features_per_partition=1536)


@pytest.mark.parametrize("weight, scales, in_features, match", [
    (torch.zeros(8, 128, dtype=torch.int16), torch.zeros(8, 16, dtype=torch.float16), 2048,
     r"m\.o_proj\.weight: expected int32 \[8, 128\].*got int16 \[8, 128\]"),
    (torch.zeros(8, 64, dtype=torch.int32), torch.zeros(8, 16, dtype=torch.float16), 2048,
     r"m\.o_proj\.weight: expected int32 \[8, 128\].*got int32 \[8, 64\]"),
    (torch.zeros(8, 128, dtype=torch.int32), torch.zeros(8, 16, dtype=torch.bfloat16), 2048,
     r"m\.o_proj\.scales: expected float16 \[8, 16\].*got bfloat16"),
    (torch.zeros(8, 128, dtype=torch.int32), torch.zeros(8, 8, dtype=torch.float16), 2048,
     r"m\.o_proj\.scales: expected float16 \[8, 16\].*got float16 \[8, 8\]"),
    (torch.zeros(8, 96, dtype=torch.int32), torch.zeros(8, 12, dtype=torch.float16), 1536,
     "input width 1536 is not a multiple of hadamard_block 1024"),
    (torch.full((8, 128), -1, dtype=torch.int32), torch.zeros(8, 16, dtype=torch.float16), 2048,
     r"16384 two-bit codes are 0b11"),
])
def test_check_module_tensors_errors(weight, scales, in_features, match):
    with pytest.raises(ValueError, match=match):
        check_module_tensors("m.o_proj", weight, scales, 8, in_features, _cfg())


def test_is_ternary_module_last_component_only():
    assert TERNARY_MODULES == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "in_proj_qkvz",
                               "out_proj", "lm_head")
    for prefix in ("model.layers.0.self_attn.qkv_proj", "model.layers.3.mlp.gate_up_proj", "lm_head",
                   "model.language_model.layers.1.linear_attn.in_proj_qkvz", "mtp.layers.0.mlp.down_proj"):
        assert is_ternary_module(prefix), prefix
    for prefix in ("model.layers.0.linear_attn.in_proj_ba", "model.embed_tokens", "model.layers.0.mlp",
                   "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj_x", "qkv_proj.extra"):
        assert not is_ternary_module(prefix), prefix
