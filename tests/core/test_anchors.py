"""benchmarks/anchors.py hands gemlite (the issue-19 anchor of `make bench-layers`) our codes in HQQ's form,
W = (W_q - zero) · scale per group of 128; were that conversion wrong, the anchor would time another layer. The
timing itself needs a CUDA GPU. benchmarks/layers.py's served copies (x unrotated, its default) must be the same
layer behind a rotation: checked here on CPU against the float32 maths."""

import torch

from benchmarks.anchors import hqq_form
from bonsai_vllm.ternary.format import pack_ternary
from bonsai_vllm.ternary.reference import dequantize, signed_block_hadamard


def test_hqq_form_is_the_same_layer():
    g = torch.Generator().manual_seed(3)
    packed = pack_ternary(torch.randint(-1, 2, (48, 512), generator=g, dtype=torch.int8))
    scales = (0.01 + 0.04 * torch.rand(48, 4, generator=g)).to(torch.float16)
    w_q, s, zero = hqq_form(packed, scales)
    assert w_q.dtype == torch.uint8 and w_q.shape == (48, 512) and set(w_q.unique().tolist()) == {0, 1, 2}
    groups = (w_q.float() - zero).view(48, 4, 128) * s.float()[:, :, None]
    assert torch.equal(groups.view(48, 512), dequantize(packed, scales, 128).float())


def test_unrotated_copies_rotate_x_themselves(monkeypatch):
    # the layer's own maths on CPU (the reference route), whatever an interpreted kernel module left set; the
    # kernel modules are imported here, not at collection (tests/core/interpreter_scope.py says why)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from benchmarks import kernels as bk
    from benchmarks.layers import served_with_signs
    from bonsai_vllm.ternary.kernels import linear

    layer = bk.served_copies(64, 2048, "cpu", seed=7, l2=1 << 20)
    tws, signs = served_with_signs(layer)
    assert len(tws) == len(layer.tern) and signs.shape == (2048,) and set(signs.unique().tolist()) == {-1.0, 1.0}
    x = bk.randn(3, 2048, device="cpu", seed=5, dtype=torch.float32)
    want = signed_block_hadamard(x, signs, 1024) @ layer.w_ref.t()
    y = linear.ternary_linear(x, tws[-1], rotated=False)
    assert ((y.float() - want).norm() / want.norm()).item() < 1e-5
    # and a width that is not whole blocks keeps the rotated-input copies, as down_proj is served
    odd = bk.served_copies(64, 1152, "cpu", seed=7, l2=1 << 20)
    assert served_with_signs(odd) == (odd.served, None)
