"""KV pool of Ternary-Bonsai-2-27B on 2 × 12 GB (TP=2) per KV format, as vLLM 0.32 sizes and reports it.

    PYTHONPATH=plugin python -m bonsai_vllm.kv.capacity      # prints both tables below

Naive arithmetic (docs/design.md §1): only the 16 full-attention layers hold KV; each GPU keeps 2 of the 4 KV
heads, so a token costs 16 · 2 · B bytes per GPU (B = bytes per token per KV head: bf16 1024, TurboQuant
k3v4 230, TurboQuant 4-bit 262, K3V2 168, K2V2 136), and pool ≈ KV bytes / that.

What vLLM 0.32 actually does for this hybrid (read from its source, `platforms/interface.py`
`_align_hybrid_block_size`, `v1/core/kv_cache_utils.py` `get_max_concurrency_for_kv_cache_config`,
`v1/kv_cache_interface.py` `MambaSpec`):

1. The 48 Gated-DeltaNet layers' state lives in the same block pool. One GDN layer's state per sequence
   per GPU is a conv state [5120, 3 + num_spec] plus an SSM state [24, 128, 128] (bf16: 827,392 B with
   one MTP token). The attention block size is raised to the smallest multiple of the backend's
   kernel block (16) whose page (block_size · 2 heads · B) holds that state; GDN pages are padded to it.
2. Layers are grouped 16 per group: 1 attention group + 3 GDN groups share 16 tensors of num_blocks
   pages each, so num_blocks = KV memory // (16 · page).
3. The reported "GPU KV cache size" is max_concurrency × max_model_len with max_concurrency =
   num_blocks / blocks-per-request, and a request at max_model_len takes cdiv(max_model_len,
   block_size) attention blocks plus, per GDN group, 2 + num_spec blocks with prefix caching's
   "align" mode (1 + num_spec without). The GDN blocks of every sequence are thus charged against the
   pool, which is why it comes out smaller than the naive figure.

With report 002's settings (max_model_len 131072, MTP 1, prefix caching align, bf16 GDN state) this
reproduces every pool of the field reports exactly (`reconcile()`); see docs/kv-cache.md. The reports and
the sections cited here ("002 §4.2") are described in docs/field-reports.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bonsai_vllm.kv.format import K2V2, K3V2

GIB = 1 << 30

# Ternary-Bonsai-2-27B (docs/design.md §1)
ATTN_LAYERS = 16
GDN_LAYERS = 48
KV_HEADS = 4
HEAD_DIM = 256
GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_HEAD_DIM, GDN_CONV_KERNEL = 16, 48, 128, 4

# Bytes per token per KV head at head_dim 256.
KV_BYTES = {
    "bf16": 2 * 2 * HEAD_DIM,  # K and V, 2 bytes each
    "turboquant_k3v4_nc": (96 + 2) + (128 + 4),  # 3-bit K + fp16 norm, 4-bit V + fp16 scale/zero = 230
    "turboquant_4bit_nc": (128 + 2) + (128 + 4),  # report 002's "TurboQuant 4bit" = 262
    "k3v2": K3V2.slot_bytes,  # 168
    "k2v2": K2V2.slot_bytes,  # 136
}


@dataclass(frozen=True)
class PoolSettings:
    """The serving settings that change the pool (defaults: report 002's serve.sh)."""

    max_model_len: int = 131072
    num_spec: int = 1  # MTP speculative tokens
    mamba_align: bool = True  # prefix caching on a hybrid: mamba_cache_mode "align"
    kernel_block: int = 16  # smallest kernel block size of the attention backend
    tp: int = 2
    gdn_state_bytes_per_el: int = 2  # bf16 GDN state (report 002 §7: fp32 costs 16.5% of the pool)


def gdn_state_bytes(s: PoolSettings = PoolSettings()) -> int:
    """One GDN layer's state per sequence per GPU: conv [conv_dim/tp, 3 + num_spec] + ssm [v_heads/tp, 128, 128]."""
    conv_dim = GDN_HEAD_DIM * GDN_KEY_HEADS * 2 + GDN_HEAD_DIM * GDN_VALUE_HEADS
    conv = conv_dim // s.tp * (GDN_CONV_KERNEL - 1 + s.num_spec)
    ssm = GDN_VALUE_HEADS // s.tp * GDN_HEAD_DIM * GDN_HEAD_DIM
    return (conv + ssm) * s.gdn_state_bytes_per_el


def naive_pool(fmt: str, kv_bytes: float, tp: int = 2) -> int:
    """docs/design.md §1's naive arithmetic: KV bytes per GPU / (16 layers · KV heads per GPU · bytes per
    token-head)."""
    return int(kv_bytes // (ATTN_LAYERS * (KV_HEADS // tp) * KV_BYTES[fmt]))


def vllm_pool(fmt: str, kv_bytes: float, s: PoolSettings = PoolSettings()) -> dict:
    """vLLM 0.32's block geometry and reported pool for `kv_bytes` of KV memory per GPU."""
    per_tok = (KV_HEADS // s.tp) * KV_BYTES[fmt]  # one attention layer, one GPU
    mamba = gdn_state_bytes(s)
    k = s.kernel_block
    block = k * math.ceil(mamba / (k * per_tok))
    page = block * per_tok
    groups_gdn = GDN_LAYERS // ATTN_LAYERS  # 3 groups of 16 GDN layers beside the attention group
    num_blocks = int(kv_bytes // (ATTN_LAYERS * page))
    attn_blocks = math.ceil(s.max_model_len / block)
    gdn_blocks = (2 if s.mamba_align else 1) + s.num_spec
    per_request = attn_blocks + groups_gdn * gdn_blocks
    concurrency = num_blocks / per_request
    return {"format": fmt, "bytes_per_token_head": KV_BYTES[fmt], "block_size": block, "page_bytes": page,
            "gdn_state_bytes": mamba, "num_blocks": num_blocks, "blocks_per_request": per_request,
            "max_concurrency": concurrency, "pool": int(concurrency * s.max_model_len),
            "naive_pool": naive_pool(fmt, kv_bytes, s.tp), "kv_bytes": num_blocks * ATTN_LAYERS * page}


def kv_budget_interval(fmt: str, pool: int, s: PoolSettings = PoolSettings()) -> tuple[int, int, int] | None:
    """KV bytes per GPU [lo, hi) for which vllm_pool reports exactly `pool` (and its num_blocks), else None."""
    g = vllm_pool(fmt, 0, s)
    n = round(pool * g["blocks_per_request"] / s.max_model_len)
    for nb in (n - 1, n, n + 1):
        if nb > 0 and int(nb / g["blocks_per_request"] * s.max_model_len) == pool:
            unit = ATTN_LAYERS * g["page_bytes"]
            return nb * unit, (nb + 1) * unit, nb
    return None


# The field reports' pools (report 002 §4; "before/after" of its SSD-embedding table), our attribution.
REPORTED = [
    # (label, format, pool, what the report says)
    ("TurboQuant 4bit (10/29 setup)", "turboquant_4bit_nc", 282089, "002 §4.2: 262 B, 282,089"),
    ("OSCAR K2V2", "k2v2", 458752, "002 §4.2: 136 B, 458,752"),
    ("OSCAR K3V2 (adopted)", "k3v2", 378652, "002 §4.2: 168 B, 378,652"),
    ("K2V2 + SSD embeddings", "k2v2", 627633, "002 §4.3: 458,752 -> 627,633 (the 'before' is the K2V2 pool)"),
    ("K3V2 final, 16 seqs", "k3v2", 424423, "002 §4.1: 424,423 (x1.50)"),
]

# KV bytes per GPU that reproduce both of report 002's same-day K2V2 and K3V2 pools: their exact
# intervals (kv_budget_interval) overlap on [2,420,547,584, 2,424,102,912); this is the midpoint.
REPORT_002_KV_BYTES = 2_422_325_248


def reconcile(s: PoolSettings = PoolSettings()) -> list[dict]:
    rows = []
    for label, fmt, pool, note in REPORTED:
        iv = kv_budget_interval(fmt, pool, s)
        rows.append({"label": label, "format": fmt, "reported": pool, "note": note,
                     "kv_bytes_lo": iv[0] if iv else None, "kv_bytes_hi": iv[1] if iv else None,
                     "num_blocks": iv[2] if iv else None,
                     "design_naive_bytes": pool * ATTN_LAYERS * (KV_HEADS // s.tp) * KV_BYTES[fmt]})
    return rows


def capacity_table(kv_bytes: float = REPORT_002_KV_BYTES, s: PoolSettings = PoolSettings()) -> list[dict]:
    """The pool of every format at one KV budget per GPU (default: report 002's)."""
    return [vllm_pool(f, kv_bytes, s) for f in ("bf16", "turboquant_4bit_nc", "turboquant_k3v4_nc", "k3v2", "k2v2")]


def kv_budget(gpu_bytes: float, utilization: float, weights_bytes: float, other_bytes: float) -> float:
    """KV memory per GPU = utilization · total - weights - everything else vLLM profiles (activations,
    CUDA graphs, sampler, non-torch). For report 002's RTX 5070 (12,227 MiB), 0.72, 5.24 GiB of weights,
    REPORT_002_KV_BYTES implies about 1.1 GiB of "everything else"."""
    return utilization * gpu_bytes - weights_bytes - other_bytes


# ---------------------------------------------------------------------------------------------------------
# The start-up plan (`bonsai-serve --check`): what one GPU holds with the served settings, and whether vLLM
# will start. vLLM 0.32 refuses to start when the pool cannot hold one request of max_model_len
# (kv_cache_utils.check_enough_kv_cache_memory); this says so in a second, with the numbers, instead of
# after minutes of loading.

# Bytes per token per KV head of the formats as the served backends page them (`--kv-cache-dtype`): K3V2
# pages carry a bf16 sink/ring share (kv/paged.py: 168 + 32), and its kernel block is 128 tokens.
KV_BYTES["fp8"] = KV_BYTES["bf16"] // 2
KV_BYTES["k3v2_paged"] = K3V2.slot_bytes + 4 * HEAD_DIM // 32  # paged.content_bytes (that module needs torch)
SERVED_KV = {"auto": ("bf16", 16), "bfloat16": ("bf16", 16), "fp8": ("fp8", 16),
             "turboquant_4bit_nc": ("turboquant_4bit_nc", 16), "turboquant_k3v4_nc": ("turboquant_k3v4_nc", 16),
             "k3v2": ("k3v2_paged", 128)}  # --kv-cache-dtype -> (KV_BYTES entry, kernel block)
# Weights per GPU at TP=2 (report 002 §4.3, RTX 5070): with the embedding table on the GPU, and with only its
# 32,000 hot rows there (SSD embeddings).
WEIGHTS_PER_GPU = {"dense embedding": 5.24 * GIB, "SSD embeddings": 4.36 * GIB}
# Everything else vLLM profiles per GPU (activations at MAX_BATCHED_TOKENS 2048, CUDA graphs, sampler,
# NCCL and CUDA context): what report 002's measured pools leave of 0.72 · 12,227 MiB after the weights.
RUNTIME_PER_GPU = int(0.72 * 12227 * (1 << 20) - WEIGHTS_PER_GPU["dense embedding"] - REPORT_002_KV_BYTES)


@dataclass(frozen=True)
class Plan:
    gpu_bytes: int
    gpus: int
    utilization: float
    kv_format: str
    max_model_len: int
    seqs: int
    num_spec: int
    ssd_embeddings: bool
    weights: int
    runtime: int
    kv_bytes: int
    pool: dict | None  # vllm_pool's answer, None when the format is unknown

    @property
    def fits(self) -> bool:
        return self.kv_bytes > 0 and self.pool is not None and self.pool["max_concurrency"] >= 1

    @property
    def gdn_state_per_seq(self) -> int:
        return self.pool["gdn_state_bytes"] * GDN_LAYERS if self.pool else 0


def plan(gpu_bytes: int, *, gpus: int = 2, tp: int = 2, utilization: float = 0.72, kv: str = "auto",
         max_model_len: int = 131072, seqs: int = 24, num_spec: int = 1, ssd_embeddings: bool = True,
         weights: int | None = None, runtime: int = RUNTIME_PER_GPU) -> Plan:
    """The memory plan of one GPU of `gpu_bytes` for the 27B at these settings (weights as report 002
    measured them unless given)."""
    w = weights if weights is not None else WEIGHTS_PER_GPU["SSD embeddings" if ssd_embeddings else "dense embedding"]
    kv_bytes = int(utilization * gpu_bytes - w - runtime)
    pool = None
    if kv in SERVED_KV:
        name, kernel_block = SERVED_KV[kv]
        settings = PoolSettings(max_model_len=max_model_len, num_spec=num_spec, kernel_block=kernel_block, tp=tp)
        pool = vllm_pool(name, max(kv_bytes, 0), settings)
    return Plan(gpu_bytes, gpus, utilization, kv, max_model_len, seqs, num_spec, ssd_embeddings, int(w), runtime,
                kv_bytes, pool)


def largest_fitting_len(p: Plan) -> int:
    """The longest MAX_MODEL_LEN (a multiple of 1024) whose request still fits this plan's pool, 0 if none."""
    if not p.pool or p.kv_bytes <= 0:
        return 0
    lo, hi = 0, p.max_model_len
    while lo < hi:
        mid = (lo + hi + 1024) // 2 // 1024 * 1024
        if mid <= lo:
            break
        q = plan(p.gpu_bytes, gpus=p.gpus, utilization=p.utilization, kv=p.kv_format, max_model_len=mid,
                 seqs=p.seqs, num_spec=p.num_spec, weights=p.weights, runtime=p.runtime)
        lo, hi = (mid, hi) if q.fits else (lo, mid - 1024)
    return lo


def describe(p: Plan) -> list[str]:
    """The plan as the lines bonsai-serve --check prints."""
    g = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    usable = p.utilization * p.gpu_bytes
    lines = [f"per GPU ({p.gpus} × {g(p.gpu_bytes)}, MEM {p.utilization}): {g(usable)} for vLLM = weights "
             f"{g(p.weights)} ({'SSD embeddings, hot rows only' if p.ssd_embeddings else 'embedding table on the GPU'})"
             f" + runtime {g(p.runtime)} + KV cache {g(max(p.kv_bytes, 0))}"]
    if p.pool is None:
        lines.append(f"KV format {p.kv_format!r}: not in the capacity model ({', '.join(SERVED_KV)}); no pool estimate")
        return lines
    pool = p.pool
    lines.append(f"KV pool ({p.kv_format}, {pool['bytes_per_token_head']} B per token per KV head, block "
                 f"{pool['block_size']} tokens): {pool['pool']:,} tokens at MAX_MODEL_LEN {p.max_model_len:,}")
    lines.append(f"GDN state per running sequence: {p.gdn_state_per_seq / (1 << 20):.1f} MiB (48 layers, in the pool)")
    lines.append(f"sequences of MAX_MODEL_LEN that fit at once: {pool['max_concurrency']:.2f}; SEQS {p.seqs} share "
                 f"{pool['pool']:,} tokens ({pool['pool'] // max(p.seqs, 1):,} each if all are running)")
    return lines


def fixes(p: Plan) -> list[str]:
    """What to change when the plan does not fit, each with the pool it would give."""
    out = []
    if p.pool is None:
        return out
    if p.kv_format != "k3v2":
        k = plan(p.gpu_bytes, gpus=p.gpus, utilization=p.utilization, kv="k3v2", max_model_len=p.max_model_len,
                 seqs=p.seqs, num_spec=p.num_spec, weights=p.weights, runtime=p.runtime)
        if k.fits:
            out.append(f"KV=k3v2 (3-bit keys, 2-bit values): pool {k.pool['pool']:,} tokens, "
                       f"{k.pool['max_concurrency']:.1f} sequences of {p.max_model_len:,}")
    n = largest_fitting_len(p)
    if n:
        out.append(f"MAX_MODEL_LEN={n} (the longest that fits with KV={p.kv_format})")
    if p.utilization < 0.9:
        hi = plan(p.gpu_bytes, gpus=p.gpus, utilization=0.9, kv=p.kv_format, max_model_len=p.max_model_len,
                  seqs=p.seqs, num_spec=p.num_spec, weights=p.weights, runtime=p.runtime)
        if hi.fits:
            out.append(f"MEM=0.9 (only if no other program uses these GPUs): pool {hi.pool['pool']:,} tokens")
    if not p.ssd_embeddings:
        out.append("SSD_EMBED_DIR=/models/bonsai/embed_ssd (model-fetch exports it): 0.88 GiB more per GPU")
    return out


def main() -> None:
    print("Reported pools reconciled (vLLM 0.32 accounting: max_model_len 131072, MTP 1, align, bf16 GDN):")
    print(f"{'pool':<32}{'format':<22}{'reported':>10}{'blocks':>8}{'KV GiB/GPU (exact interval)':>32}"
          f"{'naive GiB':>11}")
    for r in reconcile():
        iv = (f"{r['kv_bytes_lo'] / GIB:.3f} - {r['kv_bytes_hi'] / GIB:.3f}" if r["kv_bytes_lo"] else "no fit")
        print(f"{r['label']:<32}{r['format']:<22}{r['reported']:>10,}{r['num_blocks'] or '-':>8}{iv:>32}"
              f"{r['design_naive_bytes'] / GIB:>11.3f}")
    print(f"\nPool per format at report 002's KV budget ({REPORT_002_KV_BYTES / GIB:.3f} GiB per GPU):")
    print(f"{'format':<22}{'B/tok/head':>11}{'block':>7}{'blocks':>8}{'blk/req':>8}{'pool':>10}{'naive':>10}")
    for r in capacity_table():
        print(f"{r['format']:<22}{r['bytes_per_token_head']:>11}{r['block_size']:>7}{r['num_blocks']:>8}"
              f"{r['blocks_per_request']:>8}{r['pool']:>10,}{r['naive_pool']:>10,}")


if __name__ == "__main__":
    main()
