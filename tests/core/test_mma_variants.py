"""The mma kernel's kept variants (benchmarks/variants/*.patch, timed by benchmarks.mma_variants) still apply to the
tree's mma.cu and build, so the next GPU round can time them; a patch that no longer applies says so. No GPU:
NVRTC from PyTorch's CUDA wheels, as in make compile-check."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks import mma_variants

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton's cuobjdump reads the cubins")


@pytest.mark.parametrize("name", sorted(mma_variants.DEFAULT_VARIANTS))
def test_kept_variant_applies_and_builds_the_served_instance(name):
    patches = mma_variants.parse_variants(None)[name]
    source = mma_variants.build(patches)
    text = source.read_text()
    assert text != mma_variants.TREE_SOURCE.read_text(), "the patches changed nothing"
    # gate_up's 64-row instance on the H100 / H200 rule: the one these variants were written for
    instance = mma_variants.instances([64], ["gate_up"], mma_variants.mma.H200)["gate_up:64"]
    regs, stack, count = mma_variants.resources(source, instance, "90")
    tree_regs, _, tree_count = mma_variants.resources(mma_variants.TREE_SOURCE, instance, "90")
    assert 0 < regs <= 255 and stack == 0 and count > 1000 and tree_count > 1000
    assert count != tree_count or regs != tree_regs  # a different kernel, not the tree's under another name


def test_a_patch_that_does_not_apply_names_itself(tmp_path):
    bad = tmp_path / "stale.patch"
    bad.write_text("diff --git a/mma.cu b/mma.cu\n--- a/mma.cu\n+++ b/mma.cu\n@@ -1,1 +1,1 @@\n-no such line\n+x\n")
    with pytest.raises(SystemExit, match="stale.patch does not apply to the tree's mma.cu"):
        mma_variants.main(["--variant", f"stale={bad}", "--resources", "--ms", "64", "--layers", "gate_up"])
