"""The streaming GEMV for one and two rows (ternary/kernels/stream_gemv.py, stream_gemv.cu) where no GPU is: its
configuration rule and grid at the 27B's shapes, the dispatch, and the launch structures handed to the CUDA driver.

The kernel itself runs only on CUDA: `make gpu-check` (every layer through ternary_linear) and `python -m
benchmarks.stream_gemv` (every configuration against dp4a.gemv_reference, and determinism) check it there;
tests/core/test_compile_check.py compiles every served instance with NVRTC for sm_90 and sm_120.
"""

from __future__ import annotations

import ctypes
import types

import pytest
import torch

from bonsai_vllm import nvrtc

LAYERS = {"gate_up": (5120, 17408), "down": (8704, 5120), "qkv": (5120, 7168), "o_proj": (3072, 5120),
          "gdn_in": (5120, 8192), "gdn_out": (3072, 5120), "lm_head": (5120, 124160)}


@pytest.fixture
def kern():
    # imported when a test runs (the kernel test modules switch Triton's interpreter on first)
    from bonsai_vllm.ternary.kernels import linear, stream_gemv

    return types.SimpleNamespace(linear=linear, sg=stream_gemv)


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("sms", [48, 132])  # RTX 5070, H200
def test_every_layer_has_a_config_and_a_grid_that_covers_its_rows(name, m, sms, kern):
    k, n = LAYERS[name]
    cfg = kern.sg.default_config(n, k, m)
    assert cfg is not None and m * cfg.rows <= 32 and cfg.words in (1, 2, 4)
    warps = cfg.warps(k)
    assert 32 * cfg.words * warps >= k // 16 > 32 * cfg.words * (warps - 1)  # whole row, no idle warp
    ctas, cap = kern.sg.grid(cfg, n, k, sms, m)
    assert ctas <= n and ctas * cap >= n  # every row belongs to a CTA whose shared memory holds it
    # the kernel's own split (blockIdx·N / gridDim) never gives a CTA more rows than cap
    assert max((b + 1) * n // ctas - b * n // ctas for b in range(ctas)) <= cap
    assert 4 * warps * m * cap < kern.sg.SHARED_MAX
    assert f"<{m}, {cfg.words}, {cfg.rows}, {k // 16}," in kern.sg.template(cfg, m, k, torch.bfloat16)


def test_rule_classes(kern):
    cls = {name: kern.sg.layer_class(n, k) for name, (k, n) in LAYERS.items()}
    assert cls == {"gate_up": "wide", "down": "deep", "qkv": "other", "o_proj": "narrow", "gdn_in": "other",
                   "gdn_out": "narrow", "lm_head": "head"}


def test_grid_grows_when_the_warp_sums_would_not_fit(kern):
    cfg = kern.sg.StreamConfig(words=1, rows=8, prefetch=False, ctas_per_sm=1)
    k, n = 8704, 1 << 20  # 17 warps; a million rows over 4 CTAs would need 17 MB of warp sums each
    ctas, cap = kern.sg.grid(cfg, n, k, sms=4)
    assert ctas > 4 and 4 * cfg.warps(k) * cap < kern.sg.SHARED_MAX and ctas * cap >= n


def test_outside_the_kernel(kern):
    assert kern.sg.default_config(100, 1000) is None  # K not whole groups of 128
    assert kern.sg.default_config(5120, 5120, 3) is None  # three rows: the per-thread partials fold by halves
    # four rows only where the rule measured a gain (the narrow layers)
    assert [name for name, (k, n) in LAYERS.items() if kern.sg.default_config(n, k, 4)] == ["o_proj", "gdn_out"]


def test_route_takes_one_and_two_rows_when_prepared(kern):
    k, n = 1024, 64
    packed = torch.zeros(n, k // 16, dtype=torch.int32)
    tw = kern.linear.prepare(packed, torch.ones(n, k // 128, dtype=torch.float16), None, dp4a=False, mma=False,
                             stream=True)
    assert tw.stream is None  # CPU tensors: the CUDA kernel is never prepared
    tw.stream = tuple(kern.sg.default_config(n, k, r) for r in (1, 2)) + (None, kern.sg.default_config(5120, 3072, 4))
    assert [kern.linear.route(m, tw).path for m in (1, 2, 3, 4, 5)] == ["stream", "stream", "gemv", "stream", "gemv"]
    assert kern.linear.route(2, tw).config == tw.stream[1]
    assert kern.linear.route(1, tw, triton_ok=False).path == "reference"


def test_launch_structures_match_the_driver_abi():
    # cuda.h: CUlaunchAttribute is an enum id padded to 8 bytes and a 64-byte value union; CUlaunchConfig is
    # seven unsigned ints, a stream, a pointer to the attributes and their count (56 bytes on 64-bit hosts)
    assert ctypes.sizeof(nvrtc._LaunchAttribute) == 72
    assert nvrtc._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(nvrtc._LaunchConfig) == 56
    assert nvrtc._LaunchConfig.stream.offset == 32 and nvrtc._LaunchConfig.attrs.offset == 40


def test_early_launch_refuses_arguments_it_cannot_pass():
    with pytest.raises(TypeError, match="tensors, ints and bytes only"):
        nvrtc.launch(object(), (1, 1, 1), (32, 1, 1), [1.5], early=True)


def test_which_prep_goes_ahead_of_the_stream_gemv():
    # Measured served on an H100 and an H200 (twenty-second session): the CUDA C prep at up to 8 CTAs (rows ·
    # K / 1024), Triton's above, ahead of the streaming GEMV only; every other route keeps the CUDA C prep.
    from bonsai_vllm.ternary.kernels import linear

    serves = {(name, m): linear.cuda_prep_serves("stream", m, k, 1024)
              for name, (k, _) in LAYERS.items() if k % 1024 == 0 for m in (1, 2, 4)}
    assert {key for key, cuda in serves.items() if not cuda} == {
        ("gate_up", 2), ("gate_up", 4), ("qkv", 2), ("qkv", 4), ("gdn_in", 2), ("gdn_in", 4), ("o_proj", 4),
        ("gdn_out", 4), ("lm_head", 2), ("lm_head", 4)}
    assert all(linear.cuda_prep_serves(path, 4, 5120, 1024) for path in ("dp4a", "mma"))
