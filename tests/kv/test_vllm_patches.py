"""plugin/patches/apply.py on scratch copies of the installed vLLM 0.32.0 tree (never on the venv's own).

Each copy is taken back to stock first (`--revert`: the venv's tree is already patched by the Makefile),
so stock and patched behaviour are both checked on the same files. Python sources are copied, everything
else (native extensions, data) symlinked.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
APPLY = REPO / "plugin" / "patches" / "apply.py"
PATCHED_FILES = ["config/cache.py", "utils/torch_utils.py", "v1/kv_cache_interface.py", "platforms/cuda.py",
                 "platforms/cpu.py"]

spec = importlib.util.find_spec("vllm")
if spec is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)
INSTALLED = Path(spec.submodule_search_locations[0])


def _copy(dst_site: Path) -> Path:
    def copy(src, dst):
        if src.endswith(".py"):
            shutil.copy2(src, dst)
        else:
            os.symlink(src, dst)

    root = dst_site / "vllm"
    shutil.copytree(INSTALLED, root, ignore=shutil.ignore_patterns("__pycache__"), copy_function=copy)
    return root


def apply(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(APPLY), "--vllm-root", str(root), *args], capture_output=True,
                          text=True, timeout=300)


def run_py(root: Path, code: str) -> dict:
    """Run `code` (which prints one JSON line last) with the copy first on sys.path and the plugin importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root.parent), str(REPO / "plugin")]),
           "VLLM_PLUGINS": ""}
    r = subprocess.run([sys.executable, "-c", f"import vllm; assert vllm.__file__.startswith({str(root)!r}), "
                        f"vllm.__file__\n{code}"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def digest(root: Path) -> dict[str, str]:
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest() for f in PATCHED_FILES}


@pytest.fixture()
def stock(tmp_path) -> Path:
    root = _copy(tmp_path / "site")
    r = apply(root, "--revert")
    assert r.returncode == 0, r.stderr
    return root


PROBE = """
import json, torch
from pydantic import ValidationError
from vllm.config import CacheConfig
out = {}
try:
    CacheConfig(cache_dtype="k3v2")
    out["k3v2_valid"] = True
except ValidationError:
    out["k3v2_valid"] = False
CacheConfig(cache_dtype="fp8")
CacheConfig(cache_dtype="turboquant_k3v4_nc")
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
out["torch_dtype"] = str(STR_DTYPE_TO_TORCH_DTYPE.get("k3v2"))
from vllm.v1.kv_cache_interface import get_kv_quant_mode, FullAttentionSpec
mode = get_kv_quant_mode("k3v2")
out["mode"] = mode.name
out["fp8_mode"] = get_kv_quant_mode("fp8").name
out["auto_mode"] = get_kv_quant_mode("auto").name
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.attention.selector import AttentionSelectorConfig
def pick(dtype):
    try:
        return CpuPlatform.get_attn_backend_cls(None, AttentionSelectorConfig(
            head_size=256, dtype=torch.bfloat16, kv_cache_dtype=dtype, block_size=None))
    except ValueError as e:
        return "ValueError: " + str(e)
out["cpu_auto"] = pick("auto")
out["cpu_k3v2_unregistered"] = pick("k3v2")
if out["k3v2_valid"]:
    from bonsai_vllm.adapters.plugin import register_k3v2_backend
    register_k3v2_backend()
    register_k3v2_backend()  # idempotent
    out["cpu_k3v2"] = pick("k3v2")
    out["cpu_auto_after"] = pick("auto")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    backend = AttentionBackendEnum["BONSAI_K3V2"].get_class()
    spec = backend.customize_spec(FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=256,
                                                    dtype=STR_DTYPE_TO_TORCH_DTYPE["k3v2"], kv_quant_mode=mode))
    out["page_per_token_head"] = spec.page_size_bytes
    spec2 = backend.customize_spec(FullAttentionSpec(block_size=2080, num_kv_heads=2, head_size=256,
                                                     dtype=STR_DTYPE_TO_TORCH_DTYPE["k3v2"], kv_quant_mode=mode))
    out["page_27b_rank"] = spec2.page_size_bytes
print(json.dumps(out))
"""


def test_stock_rejects_k3v2(stock):
    out = run_py(stock, PROBE)
    assert out["k3v2_valid"] is False
    assert out["mode"] == "NONE" and out["torch_dtype"] == "None"
    assert out["cpu_auto"].endswith("CPUAttentionBackend")


def test_apply_check_reapply_and_behaviour(stock):
    before = digest(stock)
    r = apply(stock, "--check", "--no-import-check")
    assert r.returncode == 1 and "not applied" in r.stderr, r.stderr

    r = apply(stock)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("applied 0") == 5 and "already" not in r.stdout, r.stdout
    assert "patched modules import" in r.stdout
    after = digest(stock)
    assert all(before[f] != after[f] for f in PATCHED_FILES)

    r = apply(stock, "--check")
    assert r.returncode == 0, r.stderr
    assert "verified" in r.stdout

    r = apply(stock)  # idempotent: nothing written
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("already applied") == 5 and "\napplied" not in "\n" + r.stdout
    assert digest(stock) == after

    out = run_py(stock, PROBE)
    assert out["k3v2_valid"] is True
    assert out["torch_dtype"] == "torch.uint8" and out["mode"] == "K3V2"
    assert (out["fp8_mode"], out["auto_mode"]) == ("FP8_PER_TENSOR", "NONE")  # other dtypes unchanged
    assert out["cpu_auto"].endswith("CPUAttentionBackend") and out["cpu_auto_after"] == out["cpu_auto"]
    assert out["cpu_k3v2_unregistered"].startswith("ValueError") and "bonsai_vllm" in out["cpu_k3v2_unregistered"]
    assert out["cpu_k3v2"] == "bonsai_vllm.adapters.k3v2_attention.K3V2AttentionBackend"

    from bonsai_vllm.kv.format import K3V2
    from bonsai_vllm.kv.paged import content_bytes

    # the page vLLM allocates per token per KV head: the core format's 168 B + the bf16 sinks/ring share
    assert K3V2.slot_bytes == 168
    assert out["page_per_token_head"] == content_bytes(K3V2) == 200
    assert out["page_27b_rank"] == 2080 * 2 * 200

    r = apply(stock, "--revert", "--no-import-check")
    assert r.returncode == 0 and digest(stock) == before


def test_modified_file_is_named_and_nothing_written(stock):
    f = stock / "config" / "cache.py"
    f.write_text(f.read_text().replace('    "nvfp4_4over6",\n]', '    "nvfp4_4over6",\n    "something_else",\n]'))
    before = digest(stock)
    r = apply(stock, "--no-import-check")
    assert r.returncode == 1
    assert "config/cache.py" in r.stderr and "does not match" in r.stderr, r.stderr
    assert digest(stock) == before  # checked before writing: no other file was patched


def test_half_applied_file_is_named(stock):
    assert apply(stock, "--no-import-check").returncode == 0
    f = stock / "v1" / "kv_cache_interface.py"
    text = f.read_text()
    cut = '    if kv_cache_dtype == "k3v2":  # bonsai\n        return KVQuantMode.K3V2\n'
    assert cut in text
    f.write_text(text.replace(cut, ""))
    r = apply(stock, "--no-import-check")
    assert r.returncode == 1
    assert "v1/kv_cache_interface.py" in r.stderr and "half-patched" in r.stderr, r.stderr
    r = apply(stock, "--check", "--no-import-check")
    assert r.returncode == 1 and "v1/kv_cache_interface.py" in r.stderr


def test_broken_import_fails_the_run(stock):
    assert apply(stock, "--no-import-check").returncode == 0
    f = stock / "utils" / "torch_utils.py"
    f.write_text(f.read_text() + "\nraise RuntimeError('broken on purpose')\n")
    r = apply(stock, "--check")
    assert r.returncode == 1
    assert "torch_utils" in r.stderr and "broken on purpose" in r.stderr, r.stderr[-2000:]


def test_other_versions_are_refused(stock):
    v = stock / "_version.py"
    v.write_text(v.read_text().replace("'0.32.0'", "'0.33.0'"))
    r = apply(stock, "--no-import-check")
    assert r.returncode == 1 and "0.33.0" in r.stderr and "0.32.0 only" in r.stderr, r.stderr
