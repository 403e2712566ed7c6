"""make gpu-check's script at toy sizes on the CPU (Triton's interpreter, in a subprocess: the interpreter
must be on before Triton is imported): every section runs and passes, and a kernel made 3 % wrong is caught.
The real check is the GPU run at the 27B's sizes (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(find_spec("triton") is None, reason="Triton is not installed")
REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path, code: str) -> subprocess.CompletedProcess:
    # tools/ is no installed package: the subprocess (run in tmp_path) finds it, and the plugin, from the tree
    path = os.pathsep.join([str(REPO), str(REPO / "plugin")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_INTERPRET": "1",
                                                                              "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)


def test_every_section_runs_and_passes(tmp_path):
    p = _run(tmp_path, "import sys; from tools import gpu_check; "
                       f"sys.exit(gpu_check.main(['--smoke', '--out', {str(tmp_path)!r}]))")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cases = json.loads((tmp_path / "gpu-check.json").read_text())["cases"]
    sections = {c["section"] for c in cases}
    assert sections == {"linear", "kv store", "kv decode", "kv prefill", "allreduce", "hadamard", "embeddings"}
    assert all(c["ok"] for c in cases)
    linear = {c["route"] for c in cases if c["section"] == "linear"}
    for path in ("gemv fma", "gemv dot", "int8 triton"):  # the dispatch's three paths, each taken
        assert any(r.startswith(path) for r in linear), (path, linear)
    assert {c["route"] for c in cases if c["section"] == "allreduce"} == {"bf16", "int8-triton"}
    assert "| linear |" in (tmp_path / "gpu-check.md").read_text()


def test_a_wrong_kernel_fails_the_check(tmp_path):
    # the GEMV's output 3 % off: every GEMV case must fail, and the exit status say so
    code = ("import sys; from bonsai_vllm.ternary.kernels import gemv; orig = gemv.ternary_gemv; "
            "gemv.ternary_gemv = lambda *a, **k: orig(*a, **k) * 1.03; "
            "from tools import gpu_check; "
            f"sys.exit(gpu_check.main(['--smoke', '--only', 'linear', '--out', {str(tmp_path)!r}]))")
    p = _run(tmp_path, code)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    cases = json.loads((tmp_path / "gpu-check.json").read_text())["cases"]
    gemv_cases = [c for c in cases if c["route"].startswith("gemv")]
    assert gemv_cases and not any(c["ok"] for c in gemv_cases)
    assert all(c["ok"] for c in cases if c["route"].startswith("int8"))
