"""Checkpoint directories on disk, shared by bonsai-convert, the official-pack converter and model-fetch.

- `SourceCheckpoint`: lazy reader of a safetensors checkpoint (one file, or shards with an index);
- `ShardWriter`: writes safetensors shards of at most N bytes and the index, files readable by the server;
- `atomic_directory`: the output is written beside its place and renamed in only when complete, so a
  half-written model directory never stands where a complete one is expected (an interrupted conversion
  or download leaves the old directory, or none);
- the side files (tokenizer, chat template, ...) and config.json; sizes on the command line ("5GB").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

# Files that are weights (never copied: the output's weights are ours).
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|gguf|h5|msgpack)$|.*\.index\.json$")


class SourceCheckpoint:
    """Lazy reader of a safetensors checkpoint directory (single file or sharded with an index)."""

    def __init__(self, root: Path, stack: contextlib.ExitStack) -> None:
        self.root = root
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{root}: no *.safetensors weights (and no model.safetensors.index.json); "
                                        "bonsai-convert reads safetensors checkpoints only")
            weight_map = {}
            for f in files:
                with safe_open(f, framework="pt") as handle:
                    weight_map.update({k: f.name for k in handle.keys()})
        self._map = weight_map
        self._handles = {name: stack.enter_context(safe_open(root / name, framework="pt"))
                         for name in sorted(set(weight_map.values()))}

    def keys(self) -> list[str]:
        return sorted(self._map)

    def __contains__(self, key: str) -> bool:
        return key in self._map

    def shape(self, key: str) -> list[int]:
        return self._handles[self._map[key]].get_slice(key).get_shape()

    def get(self, key: str) -> torch.Tensor:
        if key not in self._map:
            raise KeyError(f"{self.root}: tensor '{key}' is not in the checkpoint")
        return self._handles[self._map[key]].get_tensor(key)


class ShardWriter:
    """Buffers output tensors and writes safetensors shards of at most `max_bytes` (single file if one)."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self._buf: dict[str, torch.Tensor] = {}
        self._size = 0
        self._shards: list[tuple[str, list[str]]] = []  # (temporary file name, keys)
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._size + nbytes > self.max_bytes:
            self._flush()
        self._buf[key] = tensor.detach().to("cpu").contiguous()
        self._size += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        name = f"shard-{len(self._shards):05d}.tmp.safetensors"
        save_file(self._buf, self.out / name, metadata={"format": "pt"})
        # safetensors 0.8 creates the file 0600; a served model must be readable by the server's user.
        (self.out / name).chmod(0o666 & ~umask())
        self._shards.append((name, list(self._buf)))
        self._buf, self._size = {}, 0

    def close(self) -> None:
        if self._buf or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            (self.out / self._shards[0][0]).rename(self.out / "model.safetensors")
            return
        weight_map = {}
        for i, (tmp_name, keys) in enumerate(self._shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out / tmp_name).rename(self.out / name)
            weight_map.update({k: name for k in keys})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_directory(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary directory beside `out`; on success it replaces `out`, on error it is removed."""
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; remove it or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    # mkdtemp makes the directory 0700; a model directory should get the usual umask permissions.
    tmp.chmod(0o777 & ~umask())
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.rename(old / "x")
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def copy_side_files(src: Path, dst: Path) -> None:
    """Copy tokenizer, chat template, generation config, etc.: every top-level file but weights/config."""
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.startswith(".") and f.name != "config.json" \
                and not _WEIGHT_FILE.fullmatch(f.name):
            shutil.copy2(f, dst / f.name)


def read_config(src: Path) -> dict:
    path = Path(src) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; SRC must be a Hugging Face checkpoint directory")
    return json.loads(path.read_text())


def write_config(dst: Path, config: dict) -> None:
    (dst / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 5GB, 500MB)")
    unit = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}[m[2]]
    return int(float(m[1]) * unit)


def run_cli(parser: argparse.ArgumentParser, work: Callable[[], Path]) -> Path:
    """Run a converter's work; a bad input (missing file, wrong format, existing OUT) ends the program with
    `<prog>: error: <what>` and exit status 1 instead of a traceback. Nothing is left half-written: the
    converters write through atomic_directory."""
    try:
        return work()
    except (ValueError, OSError, KeyError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
