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


def test_main_loop_of_a_tensor_copy_instance_leaves_out_the_epilogue(tm):
    """With tensor copies ptxas puts the mbarrier poll's retry after the function's end and branches back into the
    stage loop from there: that span holds the epilogue (and EXIT), and is not the loop."""
    from bonsai_vllm.ternary.kernels import mma

    cfg = mma.default_config(64, 17408, 5120, mma.RTX_5070)
    assert cfg.tma
    try:
        cubin, _ = mma.compile_instance(mma.template(64, cfg, torch.bfloat16), "120")
    except OSError as e:
        pytest.skip(f"no NVRTC here: {e}")
    size, work = tm.main_loop(cubin)
    imma = 4 * cfg.gps * cfg.rtiles * cfg.tiles(64) // cfg.wm  # per stage: k-steps × row tiles × column tiles
    assert work >= imma and size < 40 * imma


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
    assert s["step_us"] == pytest.approx(s["linear_us"] + s["allreduce_us"] + s["gdn_state_us"] + s["norms_us"])
    # the norms: 128 of 4 × 5120 bf16 per row; unfused each adds a launch, fused only the 48 ahead of the GDN layers
    unfused = tm.step(tm.RTX_5070, m=1, users=1, context=0, layers=layers, fused_norm=False)
    assert unfused["norms_us"] - s["norms_us"] == pytest.approx(80 * tm.LAUNCH_US)
    assert s["norms_us"] == pytest.approx(128 * 4 * 5120 * 2 / tm.RTX_5070.bandwidth * 1e6 + 48 * tm.LAUNCH_US)


def test_emulated_layer_takes_the_largest_term(tm):
    card = tm.Card("test", 120, 48, 2.0, 1e12)
    measured_on = tm.Card("h", 90, 48, 1.0, 4e12)
    # 1024 × 1024: 256 KiB of codes + 16 KiB of scales at 1e12 B/s = 0.28 µs (+ a launch); tensor: 2·16·1024² ops
    # over 48 · 2048 · 2e9 per s = 0.17 µs; the measured 20 µs at half the clock: 10 µs
    row = {"layer": "x", "N": 1024, "K": 1024, "M": 9, "with_prep_us": 20.0, "sms": 48}
    t = tm.emulated_layer(row, card, measured_on)
    assert t["bound"] == "clock" and t["us"] == pytest.approx(10.0)
    assert t["bytes_us"] == pytest.approx((1024 * 256 + 1024 * 8 * 2) / 1e12 * 1e6 + tm.LAUNCH_US)
    assert t["tensor_us"] == pytest.approx(2 * 16 * 1024 * 1024 / (48 * tm.RTX_INT8_OPS_PER_SM_CLOCK * 2e9) * 1e6)
    fast = tm.emulated_layer({**row, "with_prep_us": 1.0}, card, measured_on)
    assert fast["bound"] == "bytes" and fast["us"] == fast["bytes_us"]


def test_emulated_steps_need_every_layer_on_the_cards_sms(tm):
    names = ("qkv", "o_proj", "gdn_in", "gdn_out", "gate_up", "down")
    rows = [{"layer": name, "N": 5120, "K": 5120, "M": m, "with_prep_us": 50.0, "sms": 48}
            for name in names for m in (24, 48)]
    lm_head = {24: {"us": 100.0}, 48: {"us": 100.0}}
    steps = tm.emulated_steps(rows, lm_head, context=0)
    assert [(s["M"], s["users"]) for s in steps] == [(24, 24), (48, 24)]
    per_layer = 50.0 * tm.H200.clock_ghz / tm.RTX_5070.clock_ghz  # clock-bound: bytes 14 µs, tensor < 3 µs
    assert steps[0]["linear_us"] == pytest.approx(16 * 2 * per_layer + 48 * 2 * per_layer + 64 * 2 * per_layer + 100)
    # a layer measured on all 132 SMs, or missing, leaves that step out
    assert [s["M"] for s in tm.emulated_steps([{**r, "sms": 132} if r["M"] == 24 else r for r in rows], lm_head, 0)] == [48]
    assert tm.emulated_steps([r for r in rows if r["layer"] != "down"], lm_head, 0) == []
