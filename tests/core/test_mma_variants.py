"""benchmarks.mma_variants, where no GPU is: its flag variants name the instances the rule would launch with those
fields changed, a patch variant builds a kernel different from the tree's, and bad specs and stale patches say what
is wrong. NVRTC from PyTorch's CUDA wheels and Triton's cuobjdump, as in make compile-check."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess

import pytest

import torch

from benchmarks import mma_variants

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton's cuobjdump reads the cubins")

mma = mma_variants.mma


def test_default_variants_switch_the_rules_code_shape_flags():
    variants = mma_variants.parse_variants(None, None)
    assert list(variants) == list(mma_variants.DEFAULT_FLAGS)
    # gate_up's 64-row instance on the H100 / H200 rule takes tensor copies and the constant start
    (m, rule), = mma_variants.rule_configs([64], ["gate_up"], mma.H200).values()
    assert rule.tma and rule.const_start
    notma, cstart, nocstart = (variants[name].config(rule) for name in ("notma", "cstart", "nocstart"))
    assert notma == dataclasses.replace(rule, tma=False) and cstart == rule
    assert nocstart == dataclasses.replace(rule, const_start=False)
    assert mma.template(m, notma, torch.bfloat16).endswith(", 2, true, false, true>")  # ks 2, flat, cstart
    assert all(v.source == mma_variants.TREE_SOURCE for v in variants.values())


def test_flag_variants_build_other_kernels_of_the_same_instance():
    # o_proj's 64-row instance (gate_up's until the twenty-sixth session, qkv's until the twenty-seventh: their
    # two-tile warps with two warps along K take 244-254 registers and spill with the offsets)
    (m, rule), = mma_variants.rule_configs([64], ["o_proj"], mma.H200).values()
    cp_async = dataclasses.replace(rule, tma=False)  # the offsets change the per-thread copies that tma replaces
    names = {flags: mma.template(m, dataclasses.replace(cp_async, row_offsets=o, const_start=c), torch.bfloat16)
             for flags in ((False, False), (True, False), (True, True)) for o, c in [flags]}
    counts = {flags: mma_variants.resources(mma_variants.TREE_SOURCE, name, "90") for flags, name in names.items()}
    for regs, stack, count in counts.values():
        assert 0 < regs <= 255 and stack == 0 and count > 1000
    # each flag takes instructions out of the stage loop (the whole kernel's count follows)
    assert counts[True, False][2] < counts[False, False][2] and counts[True, True][2] < counts[True, False][2]


def test_a_patch_variant_builds_a_kernel_unlike_the_trees(tmp_path):
    tree = mma_variants.TREE_SOURCE.read_text()
    # an edit a patch might try: a group's loop over the warp's column tiles not unrolled
    marker = "#pragma unroll\n      for (int jj = 0; jj < TJ; ++jj) {"
    assert tree.count(marker) == 1
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "a" / "mma.cu").write_text(tree)
    (tmp_path / "b" / "mma.cu").write_text(tree.replace(marker, marker.replace("unroll", "unroll 1")))
    diff = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "a/mma.cu", "b/mma.cu"], cwd=tmp_path, capture_output=True,
                          text=True).stdout
    patch = tmp_path / "no-unroll.patch"
    patch.write_text(diff)
    variant = mma_variants.parse_variants(None, [f"rolled={patch}"])["rolled"]
    assert variant.source.read_text() != tree and variant.fields == ()
    (m, rule), = mma_variants.rule_configs([16], ["o_proj"], mma.H200).values()
    name = mma.template(m, rule, torch.bfloat16)
    assert mma_variants.resources(variant.source, name, "90") != mma_variants.resources(mma_variants.TREE_SOURCE,
                                                                                         name, "90")


def test_bad_specs_and_stale_patches_say_what_is_wrong(tmp_path):
    bad = tmp_path / "stale.patch"
    bad.write_text("diff --git a/mma.cu b/mma.cu\n--- a/mma.cu\n+++ b/mma.cu\n@@ -1,1 +1,1 @@\n-no such line\n+x\n")
    with pytest.raises(SystemExit, match="stale.patch does not apply to the tree's mma.cu"):
        mma_variants.main(["--variant", f"stale={bad}", "--resources", "--ms", "64", "--layers", "gate_up"])
    with pytest.raises(SystemExit, match="FIELD one of warps, .*, tma"):
        mma_variants.parse_variants(["x=offset=1"], None)
    with pytest.raises(SystemExit, match="a positive count"):
        mma_variants.parse_variants(["x=warps=0"], None)
    wide = mma_variants.parse_variants(["two=warps=2,split=2,tma=0"], None)["two"]
    assert wide.fields == (("warps", 2), ("split", 2), ("tma", False))
    with pytest.raises(SystemExit, match="NAME not 'rule'"):
        mma_variants.parse_variants(["rule=offsets=1"], None)
