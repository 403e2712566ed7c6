"""benchmarks.ncu_layers' cases, where no GPU is: each `layer:rows[:config]` resolves to the kernel and configuration
it will profile, and a case the kernel has no configuration for stops the run before anything launches, naming the
case (one such case used to stop an Nsight Compute run after its first profile, thirty-first session)."""

from __future__ import annotations

import pytest

from benchmarks import ncu_layers

mma = ncu_layers.mma


def test_cases_resolve_to_the_rules_kernels_and_given_configurations():
    name, m, kind, cfg = ncu_layers.resolve("down:64", mma.H200)
    assert (name, m, kind) == ("down", 64, "mma") and cfg == mma.default_config(64, 5120, 8704, mma.H200)
    assert ncu_layers.resolve("o_proj:1", mma.H200)[2] == "dp4a"
    _, _, kind, cfg = ncu_layers.resolve("o_proj:4:stream", mma.H200)  # four rows stream on the narrow layers
    assert kind == "stream" and cfg == ncu_layers.stream_gemv.default_config(5120, 3072, 4)
    _, _, kind, cfg = ncu_layers.resolve("gate_up:4:stream:2,4,0,6", mma.H200)
    assert kind == "stream" and (cfg.words, cfg.rows, cfg.prefetch) == (2, 4, False)
    _, _, kind, cfg = ncu_layers.resolve("qkv:48:2,2,1,0,2,4,2", mma.H200)
    assert kind == "mma" and (cfg.warps, cfg.rtiles, cfg.split, cfg.residual, cfg.wm) == (2, 2, 1, False, 2)


@pytest.mark.parametrize("case, words", [("gate_up:4:stream", "no default configuration for gate_up at 4 rows"),
                                         ("lm_head:2", "unknown layer 'lm_head'")])
def test_a_case_without_a_kernel_stops_before_any_launch(case, words):
    with pytest.raises(SystemExit, match=words):
        ncu_layers.resolve(case, mma.H200)
