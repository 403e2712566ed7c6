"""int8mm.codes_gemm (issue 19's prefill route without W8: the int8 GEMM that decodes the 2-bit codes into W8 in its
K loop) against the W8 route it replaces, on CPU through Triton's interpreter, compiled when a GPU is present.

- the same int32 sums and rescale as int8_gemm on expand_int8's W8: the same float32 bits in the interpreter;
- the exact W8 route of ternary.reference (int8_decompose, float64 products) to float32 rounding, and the float32
  layer within the int8 path's ~1%;
- row and column tiles cut by M and N, K steps of 32, 64 and 128 (a scale group over 4, 2 or 1 steps), q read
  as int32 words (K % 512 == 0) and as bytes, negative group scales, bias, bf16 and float32 outputs;
- linear.ternary_linear takes it without W8 when prepared with codes=True or BONSAI_CODES_GEMM=1, never with W8.
The real shapes and timings: benchmarks/prefill.py on the GPU (make bench-prefill).
"""

from __future__ import annotations

import interpreter_scope
import torch

GPU = torch.cuda.is_available()
if not GPU:  # before the kernel modules are imported: @triton.jit then decorates interpreted functions
    interpreter_scope.enable()

import pytest  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed")

from bonsai_vllm import settings  # noqa: E402
from bonsai_vllm.ternary.format import pack_ternary  # noqa: E402
from bonsai_vllm.ternary.kernels import hadamard, int8mm, linear  # noqa: E402
from bonsai_vllm.ternary.kernels.int8mm import Int8GemmConfig  # noqa: E402
from bonsai_vllm.ternary.reference import dequantize, int8_decompose, ternary_linear_ref  # noqa: E402

# the modules whose @triton.jit functions these tests decorate, forgotten afterwards. Not dp4a (hadamard imports
# its group prep): test_dp4a.py, collected before this module's teardown, holds dp4a's module object, and a fresh
# import under it would give the layers it prepares another Dp4aConfig class (its own teardown forgets dp4a).
_interpreter = interpreter_scope.module_fixture([f"bonsai_vllm.ternary.kernels.{m}" for m in ("int8mm", "hadamard")])

DEV = "cuda" if GPU else "cpu"
BF16_TOL = 3e-3 if GPU else 6e-3  # a bf16 output's rounding (the interpreter truncates: test_kernels.py)


def _layer(n: int, k: int, seed: int):
    """(packed int32 [n, k/16], scales fp16 [n, k/128]) on DEV; about a third of the group scales negative."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)
    scales = 0.01 + 0.04 * torch.rand(n, k // 128, generator=g)
    scales = torch.where(torch.rand(n, k // 128, generator=g) < 0.3, -scales, scales).to(torch.float16)
    return pack_ternary(codes).to(DEV), scales.to(DEV)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEV)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "output not fully written (NaN poison left) or not finite"
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _exact_w8_route(xq, packed, scales, ts, bias=None) -> torch.Tensor:
    """The W8 route in float64 from the reference's own decomposition: exact int8 products, then the rescale."""
    w8, rs = int8_decompose(packed.cpu(), scales.cpu(), 128)
    y = (xq.cpu().double() @ w8.double().t()) * ts.cpu().double()[:, None] * rs.double()[None, :]
    return y if bias is None else y + bias.cpu().double()


# (M, N, K, config, bias): M and N cut the tiles (130 = 4 · 32 + 2 rows; 80 = 2 · 32 + 16 columns); K = 512 reads q
# as int32 words, K = 384 (3 groups) as bytes; BK = 32 / 64 / 128 spends 4 / 2 / 1 steps in each scale group.
CASES = [(1, 64, 512, Int8GemmConfig(bm=16, bn=32, bk=128, group_m=1, warps=4, stages=1, backend="codes"), False),
         (17, 80, 384, Int8GemmConfig(bm=16, bn=32, bk=64, group_m=2, warps=4, stages=1, backend="codes"), True),
         (130, 80, 512, Int8GemmConfig(bm=32, bn=32, bk=64, group_m=2, warps=4, stages=1, backend="codes"), True),
         (130, 144, 384, Int8GemmConfig(bm=64, bn=64, bk=128, group_m=4, warps=4, stages=1, backend="codes"), False),
         (40, 256, 512, Int8GemmConfig(bm=32, bn=64, bk=32, group_m=1, warps=4, stages=1, backend="codes"), True),
         # split-K: 5 groups in slices of 3 + 2; 4 groups in 2 + 2 + an empty third slice; 3 slices asked of 3 groups
         (130, 80, 640, Int8GemmConfig(bm=64, bn=32, bk=64, group_m=2, warps=4, stages=1, backend="codes", split=2),
          True),
         (17, 64, 512, Int8GemmConfig(bm=16, bn=32, bk=128, group_m=1, warps=4, stages=1, backend="codes", split=3),
          False),
         (33, 48, 384, Int8GemmConfig(bm=32, bn=32, bk=32, group_m=1, warps=4, stages=1, backend="codes", split=4),
          True)]


def _case_id(case) -> str:
    m, n, k, c, with_bias = case
    return f"M{m}-N{n}-K{k}-bm{c.bm}-bn{c.bn}-bk{c.bk}-split{c.split}" + ("-bias" if with_bias else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_codes_gemm_is_the_w8_route(case):
    m, n, k, config, with_bias = case
    packed, scales = _layer(n, k, seed=m + n + k)
    q, rs = int8mm.int8_scales(scales)
    xq, ts = hadamard.quantize_per_token(_x(m, k, seed=m))
    bias = _x(1, n, seed=n)[0] if with_bias else None
    y = int8mm.codes_gemm(xq, packed, q, ts, rs, bias, torch.float32, config=config,
                          out=torch.full((m, n), float("nan"), device=DEV))
    # the route it replaces: W8 written by expand_int8, then int8_gemm (its own tile)
    w8 = int8mm.expand_int8(packed, q)
    want = int8mm.int8_gemm(xq, w8, ts, rs, bias, torch.float32,
                            config=Int8GemmConfig(bm=32, bn=32, bk=128, group_m=1, warps=4, stages=1))
    if GPU:
        assert _rel(y, want) < 1e-6
    else:  # the same integers and the same float32 operations in the same order
        assert torch.equal(y, want)
    assert _rel(y, _exact_w8_route(xq, packed, scales, ts, bias)) < 1e-6  # float32 rescale rounding only
    # and the float32 layer: per-token int8 activations and int8 group scales cost ~1% (report 000 §4)
    x = _x(m, k, seed=m)
    ref = x @ dequantize(packed, scales, 128).t() + (0 if bias is None else bias)
    assert _rel(y, ref) < 2e-2
    yb = int8mm.codes_gemm(xq, packed, q, ts, rs, bias, torch.bfloat16, config=config,
                           out=torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV))
    assert yb.dtype == torch.bfloat16 and _rel(yb, want) < BF16_TOL


def test_the_check_sees_a_misplaced_code():
    """Codes moved by one place inside each word (what a wrong shift would decode) fail the exact check."""
    m, n, k = 17, 64, 512
    packed, scales = _layer(n, k, seed=5)
    q, rs = int8mm.int8_scales(scales)
    xq, ts = hadamard.quantize_per_token(_x(m, k, seed=6))
    config = Int8GemmConfig(bm=16, bn=32, bk=128, group_m=1, warps=4, stages=1, backend="codes")
    want = _exact_w8_route(xq, packed, scales, ts)
    assert _rel(int8mm.codes_gemm(xq, packed, q, ts, rs, None, torch.float32, config=config), want) < 1e-6
    moved = (packed << 2) | ((packed >> 30) & 3)  # code i now at bits 2i + 2 (code 15 wraps to bits 0-1)
    assert _rel(int8mm.codes_gemm(xq, moved, q, ts, rs, None, torch.float32, config=config), want) > 0.5
    other_q = torch.roll(q, 1, dims=1)  # each group read with its neighbour's scale
    assert _rel(int8mm.codes_gemm(xq, packed, other_q, ts, rs, None, torch.float32, config=config), want) > 0.1


def test_codes_gemm_refuses_what_it_cannot_tile():
    packed, scales = _layer(32, 256, seed=7)
    q, rs = int8mm.int8_scales(scales)
    xq, ts = hadamard.quantize_per_token(_x(2, 256, seed=8))
    with pytest.raises(ValueError, match="BK"):
        int8mm.codes_gemm(xq, packed, q, ts, rs, config=Int8GemmConfig(48, 32, 48, 1, 4, 1, "codes"))
    with pytest.raises(ValueError, match="packed"):
        int8mm.codes_gemm(xq, packed[:, :8], q, ts, rs)


def test_codes_default_config():
    for m in (1, 16, 64, 65, 256, 512, 2048, 4096):
        for n, k in ((17408, 5120), (5120, 8704), (5120, 3072)):
            c = int8mm.codes_default_config(m, n, k)
            assert c.backend == "codes" and 128 % c.bk == 0 and c.bk >= 32 and k % c.bk == 0
    # served prefill chunks (65-512 rows): one warpgroup whose W8 operand is 64 output rows on 3 stages, the
    # 256-row tile on qkv / GDN-in from 385 rows (2026-12-07, H100: the 128-row tile on 3 stages was the faster up to
    # 384), split-K on down_proj at 128
    for m in (65, 128, 256, 257, 384, 385, 512):
        for n, k in ((17408, 5120), (5120, 8704), (7168, 5120), (8192, 5120), (5120, 3072)):
            c = int8mm.codes_default_config(m, n, k)
            assert (c.bn, c.warps, c.stages) == (64, 4, 3), (m, n, c)
            assert c.bm == (256 if m > 384 and 6144 < n <= 16384 else 128), (m, n, c)
    assert int8mm.codes_default_config(128, 5120, 8704).split == 2
    assert int8mm.codes_default_config(512, 17408, 5120).bk == 128


# ------------------------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("rotated", [False, True])
def test_ternary_linear_takes_it_without_w8(rotated):
    m, n, k = 70, 96, 1024  # beyond GEMV_MAX_M_NO_W8: the int8 route
    g = torch.Generator().manual_seed(9)
    packed, scales = _layer(n, k, seed=10)
    signs = (torch.randint(0, 2, (k,), generator=g).float() * 2 - 1).to(DEV)
    off = dict(dp4a=False, mma=False, stream=False)
    codes = linear.prepare(packed, scales, signs, expand_int8=False, codes=True, **off)
    expand = linear.prepare(packed, scales, signs, expand_int8=False, codes=False, **off)
    kept = linear.prepare(packed, scales, signs, expand_int8=True, codes=True, **off)
    r = linear.route(m, codes)
    assert r.path == "int8" and r.config.backend == "codes" and str(r).startswith("int8 codes bm=")
    assert "W8 decoded in the kernel" in str(r)
    assert linear.route(m, expand).config.backend != "codes" and linear.route(m, kept).w8 == "kept"
    assert linear.route(linear.GEMV_MAX_M_NO_W8, codes).path == "gemv"  # decode rows keep their routes
    # past CODES_MAX_M one expansion per call costs less than decoding once per row tile
    assert linear.route(linear.CODES_MAX_M, codes).config.backend == "codes"
    assert linear.route(linear.CODES_MAX_M + 1, codes).w8 == "expanded"
    x = _x(m, k, seed=11).to(torch.bfloat16)
    xin = hadamard.block_hadamard(x, signs, 1024) if rotated else x
    bias = _x(1, n, seed=12)[0]
    y = linear.ternary_linear(xin, codes, rotated=rotated, bias=bias)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    y_expand = linear.ternary_linear(xin, expand, rotated=rotated, bias=bias)
    assert _rel(y, y_expand) < (1e-6 if GPU else 1e-12)  # the same maths through the same rounding
    ref = ternary_linear_ref(x.float(), packed, scales, signs, 128, 1024) + bias
    assert _rel(y, ref) < 2e-2 + BF16_TOL


def test_the_switch_is_on_by_default_and_read_at_prepare(monkeypatch):
    packed, scales = _layer(32, 512, seed=13)
    monkeypatch.delenv("BONSAI_CODES_GEMM", raising=False)
    settings.clear_cache()
    try:
        assert settings.get("BONSAI_CODES_GEMM") is True
        tw = linear.prepare(packed, scales, dp4a=False, mma=False, stream=False)
        assert tw.codes and linear.route(128, tw).config.backend == "codes"
        monkeypatch.setenv("BONSAI_CODES_GEMM", "0")
        settings.clear_cache()
        tw = linear.prepare(packed, scales, dp4a=False, mma=False, stream=False)
        assert not tw.codes and linear.route(128, tw).w8 == "expanded"
    finally:
        settings.clear_cache()


# ------------------------------------------------------------------------------------------- the benchmark


def test_the_benchmark_runs_through_the_interpreter(tmp_path):
    """benchmarks/prefill.py (make bench-prefill) at toy sizes on the CPU: its checks pass and it writes its
    table. A subprocess: the interpreter must be on before Triton is imported, and the smoke run changes the
    benchmark module's globals."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(repo), str(repo / "plugin")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = {k: v for k, v in os.environ.items() if not k.startswith("BONSAI_")} | {"TRITON_INTERPRET": "1",
                                                                                 "PYTHONPATH": path}
    p = subprocess.run([sys.executable, "-m", "benchmarks.prefill", "--smoke", "--out", str(tmp_path)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads((tmp_path / "prefill.json").read_text())
    assert not data["failures"] and [(r["layer"], r["M"]) for r in data["rows"]] == [("down", 65)]
    assert data["rows"][0]["served_route"].startswith("int8 codes")
    assert data["rows"][0]["expand_route"].endswith("W8 expanded") and data["rows"][0]["w8_route"].endswith("W8 kept")
    assert "codes / W8 kept" in (tmp_path / "prefill.md").read_text()
