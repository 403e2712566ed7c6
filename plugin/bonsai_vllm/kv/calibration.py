"""Calibrated KV rotations from a model's own keys: record samples while serving, then fit the rotation file.

The data-free randomized Hadamard (rotation.py) spreads outlier channels evenly only on average; the OSCAR
paper's calibrated rotation (eigenvectors of the keys' covariance in the query metric, then a Hadamard)
does so for the directions the model actually uses. The samples must be the model's post-RoPE queries,
keys and values, which only a running engine produces, so calibration has two halves:

1. `SampleRecorder` (used by the vLLM backend when BONSAI_KV_CAPTURE=DIR is set): each full-attention layer
   keeps the q, k, v of the first `tokens` tokens it sees on this rank and then writes
   DIR/layer{i}.rank{r}.safetensors once (atomically: a half-written file is never left under its name).
2. `bonsai-kv-calibrate DIR OUT` (this module's `main`): joins the ranks' KV heads, fits the rotations with
   `rotation.calibrate` and writes OUT in the format `KVRotation.from_file` reads (BONSAI_KV_ROTATION=OUT).
   It prints, per layer, the quantization error of keys and values under the data-free and the calibrated
   rotation on the samples, so the operator sees what the file buys.

No vLLM import: the format code and the CLI run anywhere torch and safetensors do.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import torch

from bonsai_vllm.kv import reference as ref
from bonsai_vllm.kv.format import K3V2
from bonsai_vllm.kv.rotation import KVRotation, calibrate, save_rotations

DEFAULT_TOKENS = 4096
_FILE = re.compile(r"layer(\d+)\.rank(\d+)\.safetensors$")


class SampleRecorder:
    """Collects q [T, Hq, D], k and v [T, Hkv, D] per layer on one rank until `tokens` tokens, then saves."""

    def __init__(self, out_dir: str | Path, rank: int, tokens: int = DEFAULT_TOKENS):
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.tokens = tokens
        self._parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._count: dict[int, int] = {}
        self.done: set[int] = set()

    def path(self, layer: int) -> Path:
        return self.out_dir / f"layer{layer}.rank{self.rank}.safetensors"

    def add(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer in self.done:
            return
        have = self._count.get(layer, 0)
        take = min(self.tokens - have, q.shape[0])
        if take <= 0:
            return
        self._parts.setdefault(layer, []).append(
            tuple(x[:take].detach().to("cpu", torch.float32) for x in (q, k, v)))
        self._count[layer] = have + take
        if self._count[layer] >= self.tokens:
            self._save(layer)

    def _save(self, layer: int) -> None:
        from safetensors.torch import save_file

        q, k, v = (torch.cat(xs).contiguous() for xs in zip(*self._parts.pop(layer)))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        final = self.path(layer)
        tmp = final.with_name(final.name + ".partial")
        save_file({"q": q, "k": k, "v": v}, str(tmp))
        os.replace(tmp, final)
        self.done.add(layer)


def load_samples(capture_dir: str | Path) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """DIR's layer{i}.rank{r} files -> {layer: (q, k, v)} with the ranks' heads joined in rank order
    (rank r holds the r-th slice of the query and KV heads under tensor parallelism)."""
    from safetensors.torch import load_file

    files: dict[int, dict[int, Path]] = {}
    for p in Path(capture_dir).iterdir():
        m = _FILE.match(p.name)
        if m:
            files.setdefault(int(m.group(1)), {})[int(m.group(2))] = p
    if not files:
        raise FileNotFoundError(f"{capture_dir}: no layer*.rank*.safetensors samples. Serve with "
                                f"--kv-cache-dtype k3v2 and BONSAI_KV_CAPTURE={capture_dir}, send text "
                                f"until every full-attention layer has written its file, then run this again.")
    out = {}
    for layer, by_rank in sorted(files.items()):
        ranks = sorted(by_rank)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"layer {layer}: samples of ranks {ranks}; every rank 0..N-1 must have written "
                             f"its file (the capture is still running, or a rank's file was lost)")
        parts = [load_file(str(by_rank[r])) for r in ranks]
        n = min(t["k"].shape[0] for t in parts)
        out[layer] = tuple(torch.cat([t[name][:n] for t in parts], dim=1) for name in ("q", "k", "v"))
    return out


def quantization_error(x: torch.Tensor, r: torch.Tensor, bits: int, clip: float) -> float:
    """Relative error of x [N, Hkv, D] rotated by r [Hkv, D, D], quantized, dequantized (norm-preserving,
    so the error in the rotated frame is the error of x)."""
    xr = torch.einsum("nhd,hde->nhe", x.float(), r)
    return ref.rel_err(ref.quantize_dequantize(xr, bits, clip), xr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bonsai-kv-calibrate",
        description="Fit calibrated K3V2 rotations (OSCAR style) from samples recorded with BONSAI_KV_CAPTURE, "
                    "and write the file BONSAI_KV_ROTATION reads.")
    ap.add_argument("capture_dir", help="directory the server wrote layer{i}.rank{r}.safetensors into")
    ap.add_argument("out", help="rotation file to write (safetensors, layers.{i}.k / layers.{i}.v)")
    ap.add_argument("--no-query-metric", action="store_true",
                    help="fit keys by their own covariance, not in the metric of the queries' second moment")
    args = ap.parse_args(argv)
    try:
        samples = load_samples(args.capture_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"bonsai-kv-calibrate: {e}", file=sys.stderr)
        return 2
    rotations = {}
    print(f"{'layer':>5} {'tokens':>6} {'heads':>5}  K3 error: hadamard → calibrated   V2 error: hadamard → calibrated")
    for layer, (q, k, v) in samples.items():
        rot = calibrate(k, v, None if args.no_query_metric else q)
        base = KVRotation.randomized_hadamard(layer, k.shape[1], k.shape[2])
        ek = [quantization_error(k, r, K3V2.k_bits, K3V2.k_clip) for r in (base.rk, rot.rk)]
        ev = [quantization_error(v, r, K3V2.v_bits, K3V2.v_clip) for r in (base.rv, rot.rv)]
        print(f"{layer:>5} {k.shape[0]:>6} {k.shape[1]:>5}  {ek[0]:24.4f} → {ek[1]:.4f} {ev[0]:24.4f} → {ev[1]:.4f}")
        rotations[layer] = rot
    out = Path(args.out)
    tmp = out.with_name(out.name + ".partial")
    save_rotations(tmp, rotations)
    os.replace(tmp, out)
    print(f"wrote {out} ({len(rotations)} layers); serve with BONSAI_KV_ROTATION={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
