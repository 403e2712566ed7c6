"""tools/fit_mma_rule.py: table entries fitted from bench-mma sweeps, on made-up sweep files (no GPU, no NVRTC:
the spill check is passed in)."""

from __future__ import annotations

import dataclasses

import json

import pytest

from bonsai_vllm.ternary.kernels.mma import MmaConfig, k_slices


@pytest.fixture
def fit_rule():
    """Imported when a test runs (tools.fit_mma_rule imports the mma module, which imports Triton: see
    tests/core/test_mma.py's kern fixture)."""
    from tools import fit_mma_rule

    return fit_mma_rule


def C(warps=4, rtiles=1, split=1, residual=False, stages=2, gps=4, wm=1, ks=1) -> MmaConfig:
    return MmaConfig(warps, rtiles, split, residual, stages, gps, wm, ks)


def sweep_file(tmp_path, name, rows, sms=48):
    """A bench-mma JSON: rows of (layer, K, N, M, {config: µs})."""
    path = tmp_path / name
    path.write_text(json.dumps({"rows": [
        {"layer": layer, "K": k, "N": n, "M": m, "sms": sms, "all": {str(c): us for c, us in times.items()}}
        for layer, k, n, m, times in rows]}))
    return path


def test_parse_reads_what_str_prints():
    for c in (C(), C(8, 2, 4, True, 3, 2, 3), C(wm=2), C(ks=4), C(2, 2, wm=3, ks=2)):
        assert MmaConfig.parse(str(c)) == c


def test_an_entry_with_warps_along_k_gives_back_its_config(fit_rule):
    # the table row carries ks as an eighth field only where it is not 1, and default_config reads it back
    from bonsai_vllm.ternary.kernels import mma

    assert fit_rule.entry(C(ks=2), 5120, 3072, 132) == (4, 1, 2, 4, 1, 0, 2, 2)
    assert fit_rule.entry(C(), 5120, 3072, 132) == (4, 1, 2, 4, 1, 0, 2)
    # the layout from the table; the code-shape flags (tensor copies, constant start) come from mma's own sets
    got = mma.default_config(24, 5120, 3072, mma.H200)
    assert dataclasses.replace(got, flat=False, row_offsets=False, const_start=False, tma=False) == C(ks=2)


def test_a_class_takes_the_config_best_over_all_its_layers(fit_rule, tmp_path):
    a, b, only_qkv = C(warps=2), C(stages=3), C(wm=2)
    path = sweep_file(tmp_path, "s.json", [
        # qkv and GDN-in share the "other" class: a is fastest on qkv, b is 1 % behind there and far ahead on
        # GDN-in; only_qkv was not timed on GDN-in
        ("qkv", 5120, 7168, 16, {a: 10.0, b: 10.1, only_qkv: 9.0}),
        ("gdn_in", 5120, 8192, 16, {a: 14.0, b: 10.0})])
    (f,) = fit_rule.fit(fit_rule.load([path]), spills=lambda m, c: False)
    assert (f.cls, f.tiles, f.config) == ("other", 2, b)
    assert f.entry == (4, 1, 3, 4, 1, 0, 2)
    assert f.losses == pytest.approx({"qkv": 10.1 / 9.0, "gdn_in": 1.0})


def test_spilling_configs_are_skipped_and_splits_become_ctas_per_sm(fit_rule, tmp_path):
    fast, split8, slow = C(rtiles=2), C(warps=8, split=8, stages=4, gps=1), C()
    old = sweep_file(tmp_path, "old.json", [("down", 8704, 5120, 24, {fast: 1.0, split8: 2.0, slow: 3.0})])
    new = sweep_file(tmp_path, "new.json", [("down", 8704, 5120, 24, {fast: 20.0, split8: 21.0, slow: 25.0})])
    points = fit_rule.load([old, new])  # the later file's point replaces the earlier one's
    assert points[0].times[fast] == 20.0
    (f,) = fit_rule.fit(points, spills=lambda m, c: c.rtiles == 2)
    assert f.config == split8 and f.skipped == [str(fast)] and f.cls == "deep" and f.tiles == 3
    warps, rtiles, stages, gps, wm, per_sm, min_groups = f.entry
    # the table row gives back eight slices on the sweep's 48 SMs: 40 row tiles of 128 rows, 68 groups
    assert (warps, rtiles, stages, gps, wm) == (8, 1, 4, 1, 1)
    assert k_slices(5120 // 128, 8704 // 128, per_sm, min_groups, 48) == 8
    assert "deep: {3: (8, 1, 4, 1, 1," in fit_rule.report([f], points, 120)


def test_a_slice_count_no_aim_gives_is_named_for_the_fixed_slices(fit_rule, tmp_path):
    # down_proj at 48 rows on three K slices (twenty-sixth session): k_slices doubles, so no CTAs-per-SM aim gives
    # three; the entry keeps the layout with one slice by its aim and the report names three for _FIXED_SLICES
    three, eight = C(wm=3, split=3), C(wm=3, split=8)
    path = sweep_file(tmp_path, "s.json", [("down", 8704, 5120, 48, {three: 28.9, eight: 31.0})], sms=132)
    (f,) = fit_rule.fit(fit_rule.load([path]), spills=lambda m, c: False)
    assert f.config == three and f.fixed == 3
    assert f.entry == (4, 1, 2, 4, 3, 0, 2)
    assert fit_rule.slice_aim(eight, 5120, 8704, 132) is not None and fit_rule.fixed_slices(eight, 5120, 8704, 132) is None
    report = fit_rule.report([f], fit_rule.load([path]), 90)
    assert "deep: {6: (4, 1, 2, 4, 3, 0, 2)}" in report and "_FIXED_SLICES: {'deep': {6: 3}}" in report
