"""Orthogonal rotations of K and V before quantization: data-free randomized Hadamard, or a calibrated file.

Convention: row vectors, x_rot = x @ R with R orthogonal [D, D], one R per (layer, K or V), optionally one
per KV head (R of shape [Hkv, D, D]). Scores are invariant, q·k = (q R)·(k R), so decode rotates the query
with R_k instead of un-rotating keys; values stay rotated and the attention output is un-rotated once,
o = o_rot @ R_vᵀ. Rotation is applied after RoPE (the cache holds post-RoPE keys).

Why rotate: a rotation spreads a few large channels (the outlier channels of LLM keys) over all D
coordinates, so a per-vector min/max quantizer with a handful of levels is not dominated by them.

- Data-free default: R = diag(s) · H_D (s a ±1 vector drawn from a seed per layer and K/V, H_D the
  normalized Sylvester Hadamard), i.e. x @ R = fwht(x ⊙ s): ternary.reference's transform.
- Calibrated ("OSCAR style", arXiv 2605.17757): from sample keys/values, R = U · P · H_D with U the
  eigenvectors of the covariance (per KV head), P a bit-reversal permutation of the sorted eigen-axes and
  H_D the Hadamard. U decorrelates; H then gives every coordinate exactly the mean variance (a random
  rotation only does so on average). The paper also weighs keys by the query covariance (the error that
  matters is q·(k̂ - k)); `calibrate(..., queries=...)` does that by whitening with the query second
  moment. Files are safetensors with `layers.{i}.k` / `layers.{i}.v`, each [D, D] or [Hkv, D, D].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from bonsai_vllm.ternary.reference import fwht, hadamard_matrix


def _signs(seed: int, layer: int, which: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + layer * 1009 + which) & 0x7FFFFFFF)
    return torch.randint(0, 2, (n,), generator=g).float() * 2 - 1


@dataclass
class KVRotation:
    """The rotations of one full-attention layer: rk, rv float32 [Hkv, D, D] (x_rot = x @ r[h])."""

    rk: torch.Tensor
    rv: torch.Tensor

    @classmethod
    def randomized_hadamard(cls, layer: int, num_kv_heads: int, head_dim: int, seed: int = 0,
                            per_head: bool = False) -> "KVRotation":
        """diag(s)·H per layer (per KV head with per_head=True), separate sign vectors for K and V."""
        h = hadamard_matrix(head_dim, torch.float64)

        def one(which: int) -> torch.Tensor:
            n = num_kv_heads if per_head else 1
            rs = [(_signs(seed, layer, which * 64 + i, head_dim).double()[:, None] * h) for i in range(n)]
            r = torch.stack(rs).float()
            return r.expand(num_kv_heads, -1, -1).contiguous()

        return cls(one(0), one(1))

    @classmethod
    def identity(cls, num_kv_heads: int, head_dim: int) -> "KVRotation":
        """No rotation: only for the deliberately broken variants the tests must catch."""
        eye = torch.eye(head_dim).expand(num_kv_heads, -1, -1).contiguous()
        return cls(eye, eye.clone())

    @classmethod
    def from_file(cls, path: str | Path, layer: int, num_kv_heads: int, head_offset: int = 0,
                  tensors: dict[str, torch.Tensor] | None = None) -> "KVRotation":
        """Layer `layer`'s rotations from a calibrated file, for KV heads [head_offset, head_offset +
        num_kv_heads) of the model (a tensor-parallel rank's slice; [D, D] entries serve every head).
        `tensors`: the file's contents if already loaded (one read for all layers)."""
        if tensors is None:
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        out = []
        for which in ("k", "v"):
            name = f"layers.{layer}.{which}"
            if name not in tensors:
                raise ValueError(f"rotation file {path} has no {name}: it was calibrated for another model "
                                 f"(layers {sorted({int(k.split('.')[1]) for k in tensors if k.startswith('layers.')})})")
            r = tensors[name].float()
            if r.ndim == 2:
                r = r.expand(num_kv_heads, -1, -1)
            elif r.ndim == 3 and r.shape[0] >= head_offset + num_kv_heads:
                r = r[head_offset:head_offset + num_kv_heads]
            if r.ndim != 3 or r.shape[0] != num_kv_heads or r.shape[1] != r.shape[2]:
                raise ValueError(f"rotation {name} in {path}: shape {tuple(tensors[name].shape)} does not fit "
                                 f"KV heads {head_offset}..{head_offset + num_kv_heads - 1}")
            err = (r.double() @ r.double().transpose(1, 2) - torch.eye(r.shape[1], dtype=torch.float64)).abs().max()
            if err > 1e-3:
                raise ValueError(f"rotation {name} in {path} is not orthogonal (max |R Rᵀ - I| = {err:.2e})")
            out.append(r.contiguous())
        return cls(*out)

    def to(self, device) -> "KVRotation":
        return KVRotation(self.rk.to(device), self.rv.to(device))

    # x [..., Hkv, D] -> x @ r[h] per head, float32. Kept as a batched matmul (not an FWHT) so the
    # randomized-Hadamard and calibrated cases share one path; full fp32 (TF32 would add ~1e-3 error).
    @staticmethod
    def _apply(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        xs = x.float()
        return torch.einsum("...hd,hde->...he", xs, r.to(xs.device))

    def rotate_k(self, k: torch.Tensor) -> torch.Tensor:
        return self._apply(k, self.rk)

    def rotate_v(self, v: torch.Tensor) -> torch.Tensor:
        return self._apply(v, self.rv)

    def rotate_q(self, q: torch.Tensor) -> torch.Tensor:
        """q [..., Hq, D] -> q @ rk[h // group]: each query head takes its KV head's key rotation."""
        hkv = self.rk.shape[0]
        g = q.shape[-2] // hkv
        return self._apply(q, self.rk.repeat_interleave(g, dim=0))

    def unrotate_out(self, o: torch.Tensor) -> torch.Tensor:
        """o_rot [..., Hq, D] -> o_rot @ rv[h // group]ᵀ."""
        hkv = self.rv.shape[0]
        g = o.shape[-2] // hkv
        return self._apply(o, self.rv.transpose(1, 2).repeat_interleave(g, dim=0))


def fwht_rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x @ (diag(s)·H) by the fast transform: the reference the dense matrices are checked against."""
    return fwht(x.float() * signs.to(x.device).float(), x.shape[-1])


def _bit_reversal(n: int) -> torch.Tensor:
    bits = n.bit_length() - 1
    return torch.tensor([int(f"{i:0{bits}b}"[::-1], 2) for i in range(n)])


def calibrate(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None = None) -> KVRotation:
    """Calibrated rotations from samples: keys/values [N, Hkv, D] (post-RoPE), queries [N, Hq, D] optional.

    Per KV head: C = covariance (keys: in the metric of the query second moment when queries are given),
    U = its eigenvectors sorted by decreasing eigenvalue, R = U[:, bitrev] · H_D.
    """
    n, hkv, d = keys.shape
    h = hadamard_matrix(d, torch.float64)
    perm = _bit_reversal(d)

    def rot(x: torch.Tensor, metric: torch.Tensor | None) -> torch.Tensor:
        rs = []
        for i in range(hkv):
            xi = x[:, i].double()
            xi = xi - xi.mean(0)
            c = xi.T @ xi / max(1, xi.shape[0] - 1)
            if metric is not None:  # weigh directions by how much queries look along them
                w = metric[i]
                ev, evec = torch.linalg.eigh(w)
                s = evec @ torch.diag(ev.clamp_min(ev.max() * 1e-6).sqrt()) @ evec.T
                c = s @ c @ s
            ev, u = torch.linalg.eigh(c)
            u = u[:, torch.argsort(ev, descending=True)]
            rs.append(u[:, perm] @ h)
        return torch.stack(rs).float()

    metric = None
    if queries is not None:
        g = queries.shape[1] // hkv
        qd = queries.double().reshape(queries.shape[0], hkv, g, d)
        metric = torch.einsum("nhgd,nhge->hde", qd, qd) / (qd.shape[0] * g)
    return KVRotation(rot(keys, metric), rot(values, None))


def save_rotations(path: str | Path, rotations: dict[int, KVRotation]) -> None:
    from safetensors.torch import save_file

    t = {}
    for layer, r in rotations.items():
        t[f"layers.{layer}.k"] = r.rk.contiguous()
        t[f"layers.{layer}.v"] = r.rv.contiguous()
    save_file(t, str(path))
