"""tools/target_model.py (issue 19's model of the RTX 5070): its SASS reading and its sums, on the compiled
sm_120 code of the served mma instance (NVRTC, no GPU). The model's figures are docs/benchmarks.md's."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tm():
    from tools import compile_check, target_model

    if not compile_check.cuobjdump().exists():
        pytest.skip("Triton's cuobjdump is not installed")
    return target_model


def test_main_loop_is_the_mma_loop(tm):
    from bonsai_vllm.ternary.kernels import mma

    try:
        cubin, _ = mma.compile_instance(mma.template(3, mma.default_config(3, 17408, 5120), torch.bfloat16), "120")
    except OSError as e:
        pytest.skip(f"no NVRTC here: {e}")
    cfg = mma.default_config(3, 17408, 5120)
    size, work = tm.main_loop(cubin)
    # one pipeline stage per iteration: per group of 128 inputs 4 k-steps × (x8 and the residual r8) = 8 IMMA
    assert cfg.gps * 60 < size < cfg.gps * 400 and work >= cfg.gps * 8


def test_layer_time_takes_the_larger_term(tm):
    card = tm.Card("test", 120, 10, 1.0, 1e9)
    main = tm.Launch("k", loop_instructions=40, weights_per_iteration=1000, passes=1, weight_bytes=1e3,
                     other_bytes=0.0)
    # issue: 40 · 1000·1000 / 1000 warp instructions over 10·4·1e9 per s = 1 µs; bytes: 1e3 B at 1e9 B/s = 1 µs
    t = tm.layer_time(card, 1000, 1000, [main])
    assert t["issue_us"] == pytest.approx(1.0) and t["bytes_us"] == pytest.approx(1.0)
    slow = tm.Launch("k", 400, 1000, 1, 1e3, 0.0)
    t = tm.layer_time(card, 1000, 1000, [slow])
    assert t["bound"] == "issue" and t["us"] == pytest.approx(10.0 + tm.LAUNCH_US)


def test_step_adds_the_parts(tm):
    layers = {name: {"us": 1.0} for name in ("qkv", "o_proj", "gdn_in", "gdn_out", "gate_up", "down", "lm_head")}
    s = tm.step(tm.RTX_5070, m=1, users=1, context=0, layers=layers)
    assert s["linear_us"] == 16 * 2 + 48 * 2 + 64 * 2 + 1
    assert s["attention_us"] == 0
    assert s["step_us"] == pytest.approx(s["linear_us"] + s["allreduce_us"] + s["gdn_state_us"])
