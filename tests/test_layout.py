"""The package's one structural rule: nothing outside `adapters/` imports vLLM (the lent GPU has no vLLM, and
the model-fetch container reuses the format and checkpoint code without it).

Two checks over every module of the plugin, model-fetch, tools/ and benchmarks/, found by walking the tree
(no hand-kept list to forget a new file in):
- statically, every `import` statement anywhere in a module (function bodies too: lazy imports count),
  followed through our own modules, so a module that imports one that imports vLLM is caught;
- dynamically, each module imported in a fresh interpreter where `import vllm` fails.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {  # folder on sys.path -> the top-level packages under it
    REPO / "plugin": ["bonsai_vllm"],
    REPO / "model-fetch": ["bonsai_fetch"],
    REPO: ["tools", "benchmarks"],
}
# The modules allowed to import vLLM. (plugin/patches/apply.py edits vLLM's tree as files and is no module of ours;
# testing/devserver.py starts vLLM as a subprocess and imports none of it.)
ALLOWED = ("bonsai_vllm.adapters",)


def modules() -> dict[str, Path]:
    found = {}
    for root, packages in ROOTS.items():
        for package in packages:
            for path in sorted((root / package).rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found[name] = path
    return found


def imported_names(path: Path, module: str) -> set[str]:
    """Every module name an import statement in the file names (absolute; relative ones resolved)."""
    names = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return names


def is_vllm(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.")


def vllm_paths() -> dict[str, list[str]]:
    """Module -> the import chain by which it reaches vLLM (only for modules that do)."""
    mods = modules()
    direct = {m: imported_names(p, m) for m, p in mods.items()}
    chains: dict[str, list[str]] = {}

    def visit(m: str, seen: tuple[str, ...]) -> list[str] | None:
        if m in chains:
            return chains[m]
        for name in sorted(direct.get(m, ())):
            if is_vllm(name):
                return [m, name]
            if name in mods and name not in seen:
                sub = visit(name, seen + (m,))
                if sub:
                    return [m, *sub]
        return None

    for m in mods:
        chain = visit(m, ())
        if chain:
            chains[m] = chain
    return chains


def _outside_adapters(m: str) -> bool:
    return not any(m == a or m.startswith(a + ".") for a in ALLOWED)


def test_the_walk_finds_the_tree():
    mods = modules()
    # Spot checks that the walk covers every root (a wrong root would make the checks below vacuous).
    for m in ("bonsai_vllm.ternary.kernels.linear", "bonsai_vllm.kv.kernels.decode", "bonsai_vllm.adapters.plugin",
              "bonsai_fetch.build", "tools.gpu_check", "benchmarks.kernels", "bonsai_vllm.testing.devserver"):
        assert m in mods, m
    assert len(mods) > 50


def test_only_adapters_import_vllm_statically():
    chains = vllm_paths()
    # The check can fail: the adapters do import vLLM, and are found to.
    assert "bonsai_vllm.adapters.quantization" in chains and "bonsai_vllm.adapters.plugin" in chains
    bad = {m: " -> ".join(c) for m, c in chains.items() if _outside_adapters(m)}
    assert not bad, f"modules outside adapters/ that reach vLLM: {bad}"


def test_only_adapters_import_vllm_at_import_time():
    names = [m for m in modules() if _outside_adapters(m) and not m.endswith("__main__")]
    code = ("import importlib, sys\n"
            "sys.modules['vllm'] = None  # any `import vllm...` now raises ImportError\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print('imported', len(sys.modules))\n")
    env_path = ":".join(str(r) for r in ROOTS)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "0"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("snippet, reaches", [
    ("import vllm\n", True),
    ("def f():\n    from vllm.config import VllmConfig\n", True),
    ("from bonsai_vllm.adapters import quantization\n", True),  # through our own module
    ("import torch\nfrom bonsai_vllm.ternary import format\n", False),
])
def test_the_static_check_sees_lazy_and_indirect_imports(tmp_path, snippet, reaches):
    # A module written the way a slip would be: the walk must see through function bodies and our modules.
    path = tmp_path / "probe.py"
    path.write_text(snippet)
    names = imported_names(path, "probe")
    chains = vllm_paths()
    hit = any(is_vllm(n) for n in names) or any(n in chains for n in names)
    assert hit == reaches


def test_no_file_points_outside_the_repository():
    # A clone has no design notes or field reports beside it: docs/design.md and docs/field-reports.md are ours.
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert "docs/design.md" in files and "docs/field-reports.md" in files
    bad = []
    for name in files:
        path = REPO / name
        if path.suffix in (".png", ".jpg") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        # (spelt in pieces so that this file does not match itself)
        for needle in ("DESIGN" + ".md", "../" + "shared/", "/work/" + "shared", "shared/" + "reports"):
            if needle in text:
                bad.append(f"{name}: {needle}")
    assert not bad, bad
