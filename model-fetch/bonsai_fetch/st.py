"""Streaming safetensors: read headers, write files whose tensors are byte ranges of other files.

Renaming the tensors of a 4 GB shard, or picking the vision tower out of the base model's shards, needs no
decoding: the new file's header names the tensors, and their bytes are copied range by range from the
source (`os.copy_file_range` where the kernel has it). Memory stays flat and the bytes are exactly the
source's. In-memory tensors (an MLX layout undone) can be mixed in.

Format (safetensors): 8-byte little-endian header length, a JSON header `{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}` padded with spaces to a multiple of 8, then the data.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

TORCH_TO_ST = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
               torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.uint32: "U32",
               torch.int64: "I64", torch.bool: "BOOL"}
_MAX_HEADER = 100 << 20
_CHUNK = 16 << 20


class SafetensorsError(ValueError):
    """A file that is not a well-formed safetensors file."""


@dataclass(frozen=True)
class TensorRef:
    """One tensor's place in a safetensors file."""

    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets of the tensor's bytes
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> dict[str, TensorRef]:
    """The tensors of a safetensors file, by name (metadata dropped), with their absolute byte ranges."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} does not fit the file ({size} bytes); truncated "
                                   "or not safetensors")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{path}: header is not JSON ({e})") from None
    base = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end or base + end > size:
            raise SafetensorsError(f"{path}: tensor {name} lies outside the file (offsets {begin}..{end})")
        out[name] = TensorRef(path, name, entry["dtype"], tuple(entry["shape"]), base + begin, base + end)
    return out


def _copy_range(src: Path, begin: int, length: int, dst_file) -> None:
    with open(src, "rb") as s:
        if hasattr(os, "copy_file_range"):
            dst_file.flush()
            done = 0
            try:
                while done < length:
                    n = os.copy_file_range(s.fileno(), dst_file.fileno(), length - done, begin + done)
                    if n == 0:
                        raise SafetensorsError(f"{src}: ended before byte {begin + length}")
                    done += n
                # copy_file_range moved the kernel's file position; keep Python's buffered view in step.
                dst_file.seek(0, os.SEEK_END)
                return
            except OSError as e:
                if done:
                    raise
                if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
                    raise  # those mean "not here": fall back to read/write below
        s.seek(begin)
        left = length
        while left:
            chunk = s.read(min(left, _CHUNK))
            if not chunk:
                raise SafetensorsError(f"{src}: ended before byte {begin + length}")
            dst_file.write(chunk)
            left -= len(chunk)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write(path: Path, tensors: dict[str, TensorRef | torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write `tensors` (name -> a TensorRef to copy, or a tensor) to `path` in name order. Returns its size."""
    entries = []
    offset = 0
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    for name in sorted(tensors):
        src = tensors[name]
        if isinstance(src, TensorRef):
            dtype, shape, nbytes = src.dtype, list(src.shape), src.nbytes
        else:
            if src.dtype not in TORCH_TO_ST:
                raise SafetensorsError(f"{name}: dtype {src.dtype} has no safetensors name")
            dtype, shape, nbytes = TORCH_TO_ST[src.dtype], list(src.shape), src.numel() * src.element_size()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        entries.append((name, src))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, src in entries:
            if isinstance(src, TensorRef):
                _copy_range(src.path, src.begin, src.nbytes, f)
            else:
                f.write(tensor_bytes(src))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset
