"""A model of one rank's decode step on the target card, from the compiled sm_120 code (issue 19). No GPU.

    PYTHONPATH=plugin python -m tools.target_model [--context 8192] [--json FILE]

Nobody here has an RTX 5070, so its times are predicted, not measured. For each per-rank layer and batch rows
M, the served route (kernels.linear.route, with the stream, dp4a and mma routes prepared as on CUDA) is compiled
for the card as it would be at load (Triton's compiler and ptxas through compile_check's stand-in driver; NVRTC
for mma.cu and stream_gemv.cu), and the main loop of its SASS (cuobjdump) is read: instructions per iteration and the weights
one iteration covers, hence instructions per weight. Then, per launch,

    issue  = instructions per weight · N·K · passes over the weights / (SMs · 4 schedulers · clock)
    bytes  = (codes + scales + output) / memory bandwidth           (activations come from L2)
    time   = max(issue, bytes) + LAUNCH_US

and the larger term names the bound. The same sums for the H200 (sm_90 code, its SMs, clock and measured copy
bandwidth) set beside what the H200 measured (docs/benchmarks.md) show what the model leaves out: latency.

Decode step of one rank at M rows (TP=2: 64 layers, 48 Gated DeltaNet + 16 attention):
    16 × (qkv + o_proj) + 48 × (GDN in + GDN out) + 64 × (gate_up + down) + LM head
  + 128 all-reduces of M × 5120 bf16 over PCIe: ALLREDUCE_FIXED_US + bytes at report 000's 2.6 MB per 0.74 ms
  + K3V2 attention: users × context × 5,376 B (16 layers' K3V2 pages per token on one rank) at
    K3V2_OVER_FLOOR × the byte time (the H200's measured ratio, docs/dev-notes.md)
  + the GDN recurrent state of every sequence read and written once (38 MB per sequence per rank in bf16)
  + the 128 RMSNorms ahead of the layers (residual add; x and residual read, both written: 4 · M × 5120 bf16) at
    their bytes plus LAUNCH_US each; with BONSAI_FUSED_NORM the 80 ahead of gate_up and qkv run inside the prep
    (their bytes, no launch of their own), the 48 ahead of the GDN layers stay.
Assumptions are the constants below, each with its source; change them to see what moves.

`--emulated RUN/mma-gemm.json` adds a second estimate of the linear layers at the rows that run (2-64) from a
measurement instead of the instruction count: `bench-mma --rtx-occupancy --sms 48` times each layer's served pair
(activation prep + mma kernel) on 48 of the H200's SMs, each holding no more CTAs than an sm_120 SM would. Only
the H200's clocks, bandwidth and tensor cores remain of the H200, so per layer (`emulated_layer`) the card's time
is the largest of that time scaled by the clocks, the card's byte time, and its int8 tensor-core time.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tools.compile_check import LAYERS, Compiled, compile_only, dump_cubin


@dataclass(frozen=True)
class Card:
    name: str
    arch: int
    sms: int
    clock_ghz: float
    bandwidth: float  # bytes/s


# RTX 5070: 48 SMs, 2.51 GHz boost, 672 GB/s (NVIDIA's specifications; the issue's figures). H200: 132 SMs,
# 1.98 GHz (nvidia-smi under load, KINDS.md), 4.22 TB/s measured copy bandwidth (docs/design.md §4).
RTX_5070 = Card("RTX 5070", 120, 48, 2.51, 672e9)
H200 = Card("H200", 90, 132, 1.98, 4.22e12)
LAUNCH_US = 3.0  # per kernel in a CUDA graph: the H200's smallest layers took ~3 µs per launch over their floor
ALLREDUCE_BYTES_PER_S = 2.6e6 / 0.74e-3  # report 000: 0.74 ms per all-reduce of 2.6 MB on the x4 link
ALLREDUCE_FIXED_US = 30.0  # assumed per-call latency of a small NCCL all-reduce over PCIe (not measured here)
K3V2_BYTES_PER_TOKEN = 5376  # per rank, 16 layers × 2 KV heads × 168 B (docs/design.md §1)
K3V2_OVER_FLOOR = 4.5  # the K3V2 decode kernel ran at 4-5× its byte floor on the H200 (docs/dev-notes.md)
GDN_STATE_BYTES = 38e6  # per sequence per rank, bf16 (docs/design.md §1); read and written once per step
HIDDEN = 5120
NORMS = 128  # two RMSNorms per decoder layer (input_layernorm, post_attention_layernorm), 64 layers
FUSED_NORMS = 80  # BONSAI_FUSED_NORM: the 64 ahead of gate_up and the 16 ahead of the attention layers' qkv
# Dense int8 tensor-core operations per SM and clock on an RTX 50 card: the RTX Blackwell whitepaper's RTX 5090
# figure, 838 TOPS over 170 SMs at 2.41 GHz (Ada's rate; half the A100's 4,096 per SM and clock).
RTX_INT8_OPS_PER_SM_CLOCK = 2048
LM_HEAD = (5120, 124160)  # per rank (K, N)
LINEAR = ("gate_up", "down", "qkv", "o_proj", "gdn_in", "gdn_out")  # the per-rank layers that step() sums
WORK = re.compile(r"\b(IMMA|HMMA|IDP|FFMA|FMUL|IMAD|LOP3)\b")
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def main_loop(cubin: bytes) -> tuple[int, int]:
    """(instructions in the loop body, its tensor/dp4a/FMA work instructions) of the cubin's main loop: of
    the backward branches (uniform ones too: `BRA.U UP0, 0x...`), the one whose body holds the most work
    instructions (ties: the shortest). A span that holds an EXIT is not a loop body: ptxas puts a wait's retry
    (mma.cu's mbarrier poll) after the function's end and branches back from there, a span over the epilogue."""
    sass = dump_cubin(cubin, "-sass")
    ins = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in _LINE.finditer(sass)]
    loops = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)\s*$", rest)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            if any(o.startswith("EXIT") for o in body):
                continue
            loops.append((sum(bool(WORK.match(o)) for o in body), -len(body), len(body)))
    if not loops:
        return len(ins), sum(bool(WORK.match(o)) for _, o, _ in ins)
    work, _, size = max(loops)
    return size, work


def weight_bytes(n: int, k: int) -> float:
    """An [N, K] ternary layer's bytes in memory: its 2-bit codes and an fp16 scale per group of 128 inputs."""
    return n * k / 4 + n * k / 128 * 2


@dataclass
class Launch:
    kernel: str
    loop_instructions: int
    weights_per_iteration: float  # of the [N, K] matrix, per warp that runs the loop body
    passes: int  # times the whole weight matrix is walked (batch tiles)
    weight_bytes: float
    other_bytes: float

    def times_us(self, card: Card, n: int, k: int) -> tuple[float, float]:
        """(issue, bytes) µs on `card` for an [N, K] layer."""
        if self.weights_per_iteration == 0:  # a prep/rotation kernel: bytes only
            return 0.0, self.other_bytes / card.bandwidth * 1e6
        warp_instructions = self.loop_instructions * n * k * self.passes / self.weights_per_iteration
        issue = warp_instructions / (card.sms * 4 * card.clock_ghz * 1e9) * 1e6
        return issue, (self.weight_bytes + self.other_bytes) / card.bandwidth * 1e6


def layer_launches(card: Card, n: int, k: int, m: int) -> tuple[str, list[Launch]]:
    """The served route for m rows and its launches, compiled for card.arch."""
    from bonsai_vllm.ternary.kernels import dp4a, hadamard, linear, mma, stream_gemv

    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 16), generator=g, dtype=torch.int32)
    scales = torch.rand(n, k // 128, generator=g).half() + 0.01
    rotated = k % 1024 != 0  # down_proj's rank gets x rotated
    signs = None if rotated else torch.ones(k)
    tw = linear.prepare(packed, scales, signs, dp4a=False, mma=False)
    tw.dp4a = tuple(dp4a.default_config(n, k, r) for r in range(1, linear.DP4A_MAX_M + 1))
    tw.mma = tuple(mma.default_config(r, n, k, mma.Gpu(card.arch, card.sms)) for r in range(1, linear.MMA_MAX_M + 1))
    tw.stream = tuple(stream_gemv.default_config(n, k, r) for r in range(1, linear.STREAM_MAX_M + 1)) or None
    route = linear.route(m, tw)
    x = torch.randn(m, k, generator=g).bfloat16()
    results: list[Compiled] = []
    cubins: dict[int, bytes] = {}
    codes_bytes = weight_bytes(n, k)
    out_bytes = m * n * 2
    with compile_only(card.arch, results, cubins):
        if route.path in ("mma", "stream"):  # the prep through Triton here; the CUDA kernel is compiled below
            dp4a.prepare(x) if rotated else hadamard.rotate_dp4a(x, signs)
        else:
            linear.ternary_linear(x, tw, rotated=rotated)
    launches = []
    for i, c in enumerate(results):
        consts = json.loads(c.constexprs)
        body, _ = main_loop(cubins[i])
        if c.kernel in ("_gemv_kernel", "_gemv_rows_kernel", "_gemv_fma_kernel", "_gemv_dot_kernel"):
            per_cta = consts["BN"] * consts["BW"] * 16
            passes = -(-m // consts["BM"]) if "BM" in consts else (m if c.kernel == "_gemv_fma_kernel" else 1)
            launches.append(Launch(c.kernel, body, per_cta // c.num_warps, passes, codes_bytes, out_bytes))
        else:  # rotation, prep, split-K reduction: small byte-bound passes over the activations
            launches.append(Launch(c.kernel, body, 0, 0, 0.0, m * k * 4.0))
    if route.path == "mma":
        cfg = route.config
        cubin, _ = mma.compile_instance(mma.template(m, cfg, torch.bfloat16), str(card.arch))
        body, _ = main_loop(cubin)
        # one iteration is one pipeline stage: a warp's 16 · rtiles rows × gps groups of 128 inputs, for its
        # 1/wm of the column tiles (wm warps walk the same weights)
        launches.append(Launch("ternary_mma", body, 16 * cfg.rtiles * 128 * cfg.gps / cfg.wm, 1, codes_bytes,
                               out_bytes))
    if route.path == "stream":
        cfg = route.config
        cubin, _ = stream_gemv.compile_instance(stream_gemv.template(cfg, m, k, torch.bfloat16), str(card.arch))
        body, _ = main_loop(cubin)
        # one iteration is one tile: a warp's R rows × 32 threads × C words of 16 weights, for all m batch rows
        launches.append(Launch("ternary_stream_gemv", body, cfg.rows * 32 * cfg.words * 16, 1, codes_bytes,
                               out_bytes))
    return str(route), launches


def layer_time(card: Card, n: int, k: int, launches: list[Launch]) -> dict:
    issue = bytes_ = 0.0
    total = 0.0
    for launch in launches:
        i, b = launch.times_us(card, n, k)
        issue, bytes_ = issue + i, bytes_ + b
        total += max(i, b) + LAUNCH_US
    main = next((la for la in launches if la.weights_per_iteration), None)
    per_weight = main.loop_instructions * main.passes / main.weights_per_iteration if main else 0.0
    return {"us": total, "issue_us": issue, "bytes_us": bytes_, "bound": "issue" if issue > bytes_ else "bytes",
            "instructions_per_weight": per_weight}


def norms_us(card: Card, m: int, fused_norm: bool) -> float:
    """The step's RMSNorms: each reads x and the residual and writes both (M × HIDDEN bf16 each); a norm of its own
    adds a launch, one fused into the prep (fused_norm: FUSED_NORMS of them) only its bytes."""
    per_norm = 4 * m * HIDDEN * 2 / card.bandwidth * 1e6
    fused = FUSED_NORMS if fused_norm else 0
    return NORMS * per_norm + (NORMS - fused) * LAUNCH_US


def step(card: Card, m: int, users: int, context: int, layers: dict, fused_norm: bool = True) -> dict:
    linear = (16 * (layers["qkv"]["us"] + layers["o_proj"]["us"]) + 48 * (layers["gdn_in"]["us"] + layers["gdn_out"]["us"])
              + 64 * (layers["gate_up"]["us"] + layers["down"]["us"]) + layers["lm_head"]["us"])
    allreduce = 128 * (ALLREDUCE_FIXED_US + m * HIDDEN * 2 / ALLREDUCE_BYTES_PER_S * 1e6)
    attention = K3V2_OVER_FLOOR * users * context * K3V2_BYTES_PER_TOKEN / card.bandwidth * 1e6
    gdn_state = 2 * users * GDN_STATE_BYTES / card.bandwidth * 1e6
    norms = norms_us(card, m, fused_norm)
    total = linear + allreduce + attention + gdn_state + norms
    return {"M": m, "users": users, "linear_us": linear, "allreduce_us": allreduce, "attention_us": attention,
            "gdn_state_us": gdn_state, "norms_us": norms, "step_us": total}


def emulated_layer(row: dict, card: Card = RTX_5070, measured_on: Card = H200) -> dict:
    """One layer's time on `card` from a bench-mma row measured on `measured_on` at the card's SM count and
    occupancy (`--rtx-occupancy --sms 48`): the largest of the served pair's time (`with_prep_us`) scaled by the
    clocks (the kernels wait on latency, which scales with the clock), the codes' and scales' bytes at the
    card's bandwidth plus a launch, and the int8 tensor-core work at the card's rate (batch rows in 8-row
    tiles)."""
    n, k, m = row["N"], row["K"], row["M"]
    terms = {"clock": row["with_prep_us"] * measured_on.clock_ghz / card.clock_ghz,
             "bytes": weight_bytes(n, k) / card.bandwidth * 1e6 + LAUNCH_US,
             "tensor": 2 * (-(-m // 8) * 8) * n * k / (card.sms * RTX_INT8_OPS_PER_SM_CLOCK * card.clock_ghz * 1e9) * 1e6}
    bound = max(terms, key=terms.get)
    return {"us": terms[bound], "bound": bound, **{f"{t}_us": v for t, v in terms.items()}}


def emulated_steps(rows: list[dict], lm_head: dict[int, dict], context: int, card: Card = RTX_5070,
                   fused_norm: bool = True) -> list[dict]:
    """Decode steps at 24 rows (24 users) and 48 rows (24 users with MTP) whose linear layers are
    `emulated_layer`'s, where the bench-mma rows hold all six layers at that M on the card's SMs; the LM head
    (not in bench-mma) from the instruction model (`lm_head`: per M)."""
    steps = []
    for m, users in ((24, 24), (48, 24)):
        at = {r["layer"]: emulated_layer(r, card) for r in rows if r["M"] == m and r.get("sms") == card.sms}
        if m not in lm_head or not set(LINEAR) <= at.keys():
            continue
        s = step(card, m, users, context, {**at, "lm_head": lm_head[m]}, fused_norm)
        steps.append({**s, "bounds": {name: t["bound"] for name, t in at.items()}})
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192, help="tokens of context per user (K3V2 attention)")
    ap.add_argument("--ms", default="1,2,3,8,16,24,48", help="batch rows to model per layer")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--emulated", metavar="JSON", type=Path,
                    help="bench-mma's JSON from a 48-SM run (--rtx-occupancy --sms 48): the linear layers measured")
    ap.add_argument("--unfused-norm", action="store_true",
                    help="every RMSNorm a kernel of its own (BONSAI_FUSED_NORM off)")
    args = ap.parse_args(argv)
    shapes = {name: LAYERS[name] for name in LINEAR}
    shapes["lm_head"] = LM_HEAD
    ms = sorted({int(v) for v in args.ms.split(",")} | {1, 2, 24, 48})
    rows, per_m = [], {}
    print("| layer | M | route | instr/weight sm_120 | RTX 5070 µs | bound | issue µs | bytes µs | H200 model µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (k, n) in shapes.items():
        for m in ms:
            route, launches = layer_launches(RTX_5070, n, k, m)
            rtx = layer_time(RTX_5070, n, k, launches)
            _, launches_90 = layer_launches(H200, n, k, m)
            h200 = layer_time(H200, n, k, launches_90)
            per_m.setdefault(m, {})[name] = rtx
            rows.append({"layer": name, "K": k, "N": n, "M": m, "route": route, "rtx5070": rtx, "h200_model": h200})
            print(f"| {name} | {m} | {route} | {rtx['instructions_per_weight']:.3f} | {rtx['us']:.1f} | "
                  f"{rtx['bound']} | {rtx['issue_us']:.1f} | {rtx['bytes_us']:.1f} | {h200['us']:.1f} |", flush=True)
    fused = not args.unfused_norm
    steps = [step(RTX_5070, m, users, args.context, per_m[m], fused) for m, users in ((1, 1), (2, 1), (24, 24), (48, 24))]
    print(f"\n| M (users) | linear ms | all-reduce ms | K3V2 attention ms ({args.context} tokens each) | GDN state ms "
          f"| RMSNorms ms ({'80 fused' if fused else 'unfused'}) | step ms |\n|---|---|---|---|---|---|---|")
    for s in steps:
        print(f"| {s['M']} ({s['users']}) | {s['linear_us'] / 1e3:.2f} | {s['allreduce_us'] / 1e3:.2f} | "
              f"{s['attention_us'] / 1e3:.2f} | {s['gdn_state_us'] / 1e3:.2f} | {s['norms_us'] / 1e3:.2f} | "
              f"{s['step_us'] / 1e3:.2f} |")
    emulated = []
    if args.emulated:
        bench = json.loads(args.emulated.read_text())["rows"]
        emulated = emulated_steps(bench, {m: per_m[m]["lm_head"] for m in per_m}, args.context, fused_norm=fused)
        print(f"\nLinear layers from {args.emulated} (H200 on 48 SMs at sm_120's occupancy; clocks, bytes and "
              "tensor rate of the RTX 5070):\n| M (users) | linear ms | all-reduce ms | step ms | tokens/s (MTP "
              "accepts 0.7) | bound per layer |\n|---|---|---|---|---|---|")
        for s in emulated:
            tokens = s["users"] * (1.7 if s["M"] > s["users"] else 1.0) / (s["step_us"] / 1e6)
            print(f"| {s['M']} ({s['users']}) | {s['linear_us'] / 1e3:.2f} | {s['allreduce_us'] / 1e3:.2f} | "
                  f"{s['step_us'] / 1e3:.2f} | {tokens:.0f} | "
                  f"{', '.join(f'{k} {v}' for k, v in s['bounds'].items())} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cards": [asdict(RTX_5070), asdict(H200)], "layers": rows,
                                               "steps": steps, "emulated_steps": emulated,
                                               "context": args.context}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
