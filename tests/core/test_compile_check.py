"""Every Triton kernel, and every instance of the CUDA C kernel NVRTC compiles at load, compiles for sm_90 (H200)
and sm_120 (RTX 50) at the 27B's shapes and fits both targets' shared-memory and register limits
(tools.compile_check; no GPU: Triton's compiler and its bundled ptxas under a stand-in driver that never
launches, and NVRTC from PyTorch's CUDA wheels). Run in a subprocess: the kernel test modules of this session
import the kernels under Triton's interpreter."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Not importorskip: Triton must not be imported in this process before the kernel test modules switch its
# interpreter on (it reads TRITON_INTERPRET once, when first imported).
if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed: nothing to compile", allow_module_level=True)

from tools.compile_check import LAYERS, SHARED_LIMIT, Compiled, ctas_per_sm, shared_for_ctas  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "plugin" / "bonsai_vllm"  # only dispatched kernels (measured-only variants are in benchmarks/)


def launchable_kernels() -> set[str]:
    """Names of the @triton.jit functions the wrappers launch (by convention *_kernel) in the package's sources,
    and of the __global__ functions of its CUDA C files (NVRTC compiles them at load)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        names |= set(re.findall(r"@triton\.jit(?:\([^)]*\))?\s*\n\s*def (_\w+_kernel)\(", path.read_text()))
    for path in PACKAGE.rglob("*.cu"):
        names |= set(re.findall(r"__global__\s+void(?:\s+__launch_bounds__\([^)]*\))?\s+(\w+)\(", path.read_text()))
    return names


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("compile") / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "tools.compile_check", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=1200, cwd=REPO)
    print(r.stdout[-6000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_kernel_compiles_for_both_targets(compiled):
    want = launchable_kernels()
    assert len(want) >= 10, want  # the scan found the kernels
    for target in (90, 120):
        got = {c["kernel"] for c in compiled if c["target"] == target}
        assert want <= got, f"sm_{target}: not compiled: {sorted(want - got)} (drive them in compile_check)"


def test_every_launch_fits_its_target(compiled):
    for c in compiled:
        assert c["registers"] > 0, c  # ptxas -v was read
        assert c["fits"], c
    # the same configurations on both targets (the dispatch picks by shape), but for the mma kernel, whose rule
    # has a table per architecture: each target compiles its own rule's instances
    by_target = {t: sorted({(c["kernel"], c["constexprs"]) for c in compiled if c["target"] == t
                            and c["kernel"] != "ternary_mma"}) for t in (90, 120)}
    assert by_target[90] == by_target[120]
    from bonsai_vllm.ternary.kernels import linear, mma

    for target, gpu in ((90, mma.H200), (120, mma.RTX_5070)):
        want = {mma.template(m, mma.default_config(m, n, k, gpu), dt) for k, n in LAYERS.values()
                for m in range(linear.DP4A_MAX_M + 1, linear.MMA_MAX_M + 1) for dt in (torch.bfloat16, torch.float32)}
        assert {c["constexprs"] for c in compiled if c["target"] == target and c["kernel"] == "ternary_mma"} == want


def test_limits_catch_an_oversized_launch():
    big = Compiled("k", 120, 4, 3, shared=SHARED_LIMIT[120] + 1024, registers=128, spill_bytes=0, constexprs="")
    assert not big.fits
    assert Compiled("k", 90, 4, 3, big.shared, 128, 0, "").fits  # the same kernel fits the H200
    assert not Compiled("k", 90, 16, 3, 1024, registers=200, spill_bytes=0, constexprs="").fits  # 512 threads × 200


def test_ctas_per_sm_follows_the_scarcest_resource():
    # registers: 64 per thread is 2,048 per warp, 32 warps per SM, four CTAs of eight warps (threads allow six
    # on sm_120, eight on the H200)
    assert ctas_per_sm(120, 256, 64, 0) == ctas_per_sm(90, 256, 64, 0) == 4
    # 105 registers round up to 112 per thread (3,584 per warp): 18 warps, four CTAs of four warps; 72 KB of
    # shared memory (+ 1 KB the driver keeps) allows three on the H200's 228 KB, one on sm_120's 100 KB
    assert ctas_per_sm(90, 128, 105, 72 * 1024) == 3
    assert ctas_per_sm(120, 128, 105, 72 * 1024) == 1
    assert ctas_per_sm(120, 512, 32, 0) == 3  # threads: 1,536 per SM on sm_120
    # the padding bench-mma --rtx-occupancy launches with holds exactly that many CTAs
    for target in (90, 120):
        for n in range(1, 7):
            assert ctas_per_sm(target, 64, 32, shared_for_ctas(target, n)) == n
