"""benchmarks/anchors.py hands gemlite (the issue-19 anchor of `make bench-layers`) our codes in HQQ's form,
W = (W_q - zero) · scale per group of 128; were that conversion wrong, the anchor would time another layer. The
timing itself needs a CUDA GPU."""

import torch

from benchmarks.anchors import hqq_form
from bonsai_vllm.ternary.format import pack_ternary
from bonsai_vllm.ternary.reference import dequantize


def test_hqq_form_is_the_same_layer():
    g = torch.Generator().manual_seed(3)
    packed = pack_ternary(torch.randint(-1, 2, (48, 512), generator=g, dtype=torch.int8))
    scales = (0.01 + 0.04 * torch.rand(48, 4, generator=g)).to(torch.float16)
    w_q, s, zero = hqq_form(packed, scales)
    assert w_q.dtype == torch.uint8 and w_q.shape == (48, 512) and set(w_q.unique().tolist()) == {0, 1, 2}
    groups = (w_q.float() - zero).view(48, 4, 128) * s.float()[:, :, None]
    assert torch.equal(groups.view(48, 512), dequantize(packed, scales, 128).float())
