"""Compile every Triton kernel at the 27B's shapes for the H200 (sm_90) and the RTX 50 series (sm_120), no GPU.

    PYTHONPATH=plugin python -m tools.compile_check [--targets 90,120] [--json FILE]

Our users run the kernels on GeForce Blackwell cards that nobody here has. A Triton kernel compiles at its
first launch, for the GPU it launches on; a configuration tuned on the H200 can fail there for lack of
resources: sm_120 gives a block at most 99 KiB of shared memory (the H200 227 KiB), and a launch whose
registers × threads exceed the SM's 64 Ki registers is refused. Neither shows up on the H200.

So this drives the real dispatch code (`kernels.linear.ternary_linear` for the six layers at every batch
size class, with and without int8 weights kept; the Hadamard, quantization, all-reduce pack/unpack kernels;
the K3V2 store, decode, merge and the prefill sub-rows; issue 19's dp4a GEMV) with CPU tensors, under a stand-in Triton driver
that names the target and never launches: each `kernel[grid](...)` becomes a warm-up compile, through
Triton's own specialization, to PTX and then a cubin by the ptxas Triton ships. For every compiled kernel
it reports shared memory, registers and spilled bytes (ptxas -v), and whether the launch fits the target.
Output values are garbage (nothing runs); only the compiled code is looked at. The CUDA C kernel
(ternary/kernels/mma.cu, compiled by NVRTC at load) is compiled the same way NVRTC does it at load, for each
target, every instance the dispatch launches; cuobjdump reads its resources. The package holds
the kernels the dispatch launches, and ternary.kernels.dp4a, checked on the GPU and on its way to being
launched (measured-only variants are in benchmarks/); every one is compiled: `tests/core/test_compile_check.py`
runs this in CI and fails when a kernel is added without being driven here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Per-block shared memory a kernel may use (opt-in maximum) and registers per SM.
SHARED_LIMIT = {90: 227 * 1024, 120: 99 * 1024}
REGISTERS_PER_SM = 64 * 1024
# Per SM, for how many CTAs of a kernel one SM holds at once (CUDA C programming guide, compute capabilities
# 9.0 and 12.0): shared memory (the driver keeps 1 KB per CTA of it) and threads. The CTA-count limit (24-32) never
# binds for kernels of 64 threads and more, so it is left out.
SHARED_PER_SM = {90: 228 * 1024, 120: 100 * 1024}
THREADS_PER_SM = {90: 2048, 120: 1536}
SHARED_RESERVED = 1024


def ctas_per_sm(target: int, threads: int, registers: int, shared: int) -> int:
    """CTAs of `threads` threads, `registers` per thread and `shared` bytes of shared memory (static + dynamic)
    that one SM of sm_<target> holds at once: registers are allocated per warp in units of 256, shared memory in
    units of 128 bytes."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = (REGISTERS_PER_SM // per_warp) // warps if per_warp else 1 << 30
    by_shared = SHARED_PER_SM[target] // (-(-shared // 128) * 128 + SHARED_RESERVED)
    return max(0, min(by_registers, by_shared, THREADS_PER_SM[target] // threads))


def shared_for_ctas(target: int, ctas: int) -> int:
    """The shared memory per CTA (static + dynamic) at which one SM of sm_<target> holds at most `ctas` CTAs."""
    return min(SHARED_LIMIT[target], (SHARED_PER_SM[target] // ctas - SHARED_RESERVED) // 128 * 128)
LAYERS = {  # per-rank TP=2 shapes (K -> N), as bench_kernels times them
    "gate_up": (5120, 17408), "down": (8704, 5120), "qkv": (5120, 7168), "o_proj": (3072, 5120),
    "gdn_in": (5120, 8192), "gdn_out": (3072, 5120)}
BATCH_ROWS = (1, 2, 3, 16, 64, 512, 2048)  # one per dispatch class of kernels.linear (GEMV, int8 tiles)
BATCH_ROWS_NO_W8 = (1, 4, 16, 64, 512)


@dataclass
class Compiled:
    kernel: str
    target: int
    num_warps: int
    num_stages: int
    shared: int
    registers: int
    spill_bytes: int
    constexprs: str

    @property
    def fits(self) -> bool:
        return (self.shared <= SHARED_LIMIT[self.target]
                and self.registers * self.num_warps * 32 <= REGISTERS_PER_SM)


class _CompileOnlyDriver:
    """The piece of Triton's active driver that a warm-up compile asks for: device, stream, target."""

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self) -> int:
        return self.target.arch  # one kernel cache per target in each JITFunction

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self) -> bool:
        return True


_PTXAS = re.compile(r"Compiling entry function '(?P<name>[^']+)'.*?Used (?P<regs>\d+) registers", re.S)
_SPILL = re.compile(r"(\d+) bytes spill stores")
# compiled kernel hash (it names the target too) -> (registers, spilled bytes), for every compile_only
# block of the run: a kernel compiled in one block sits in its JITFunction's in-memory cache in the next and
# prints nothing there (the dp4a prep runs in both the ternary_linear and the dp4a drivers)
_PTXAS_SEEN: dict[str, tuple[int, int]] = {}


@contextlib.contextmanager
def compile_only(capability: int, results: list[Compiled], cubins: dict | None = None):
    """Every `jit_fn[grid](...)` inside compiles for `capability` (fresh cache, ptxas -v captured) and
    returns without launching; `triton_runtime.usable` says yes to CPU tensors so dispatch takes the GPU
    paths, and the prep kernels compile with their early-launch trigger where a GPU would (sm_90 and later). `cubins`, if given, collects each launch's compiled code by its position in `results`."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from bonsai_vllm import triton_runtime as _triton
    from bonsai_vllm.ternary.kernels import dp4a, hadamard, linear

    ptxas = _PTXAS_SEEN

    def getitem(fn, grid):
        def launch(*args, **kwargs):
            log = io.StringIO()
            with contextlib.redirect_stdout(log):
                kernel = fn.run(*args, grid=grid, warmup=True, **kwargs)
            m = _PTXAS.search(log.getvalue())
            if m:  # a fresh compile (a cached specialization prints nothing: use what it printed then)
                ptxas[kernel.hash] = (int(m.group("regs")), sum(int(s) for s in _SPILL.findall(log.getvalue())))
            regs, spill = ptxas.get(kernel.hash, (-1, -1))
            consts = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
            results.append(Compiled(fn.fn.__name__, capability, kernel.metadata.num_warps,
                                    kernel.metadata.num_stages, kernel.metadata.shared, regs, spill,
                                    json.dumps(consts, default=str)))
            if cubins is not None:
                cubins[len(results) - 1] = kernel.asm["cubin"]
            return kernel
        return launch

    saved = (JITFunction.__getitem__, _triton.usable, linear.usable, dp4a.early_launch, hadamard.early_launch)
    # a fresh cache so every kernel compiles (and ptxas prints); removed after (12 MB a block, and the tests
    # and make compile-check run several blocks a run)
    cache = tempfile.TemporaryDirectory(prefix="bonsai-compile-check-", ignore_cleanup_errors=True)
    env = {"TRITON_CACHE_DIR": cache.name, "TRITON_DUMP_PTXAS_LOG": "1"}
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    previous_driver = driver._active  # None on a machine without a GPU: reset_active() would raise there
    driver.set_active(_CompileOnlyDriver(capability))
    JITFunction.__getitem__ = getitem
    _triton.usable = linear.usable = lambda t: True
    # the prep kernels as a GPU compiles them: with griddepcontrol.launch_dependents from sm_90 on
    dp4a.early_launch = hadamard.early_launch = lambda t: capability >= 90
    try:
        yield
    finally:
        JITFunction.__getitem__, _triton.usable, linear.usable, dp4a.early_launch, hadamard.early_launch = saved
        driver._active = previous_driver
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        cache.cleanup()


def drive_ternary() -> None:
    """ternary_linear for every layer and dispatch class: rotation (with the dp4a prep at M = 1), GEMVs,
    quantization, int8 GEMM, W8 expansion, the codes-decoding GEMM."""
    from bonsai_vllm.ternary.kernels import hadamard
    from bonsai_vllm.ternary.kernels.int8mm import default_config, rescale
    from bonsai_vllm.ternary.kernels.linear import prepare, ternary_linear

    g = torch.Generator().manual_seed(0)
    for name, (k, n) in LAYERS.items():
        packed = torch.randint(-2**31, 2**31 - 1, (n, k // 16), generator=g, dtype=torch.int32)
        scales = torch.rand(n, k // 128, generator=g).half() + 0.01
        signs = torch.ones(k)
        rotated = k % 1024 != 0  # down_proj's rank cuts a Hadamard block: callers pass x rotated
        for keep_w8, rows in ((True, BATCH_ROWS), (False, BATCH_ROWS_NO_W8)):
            tw = prepare(packed, scales, None if rotated else signs, expand_int8=keep_w8)
            for m in rows:
                ternary_linear(torch.randn(m, k, generator=g).bfloat16(), tw, rotated=rotated)
                if default_config(m, n, k).backend == "int_mm":  # on a GPU: cuBLAS _int_mm, then our rescale
                    rescale(torch.zeros(m, n, dtype=torch.int32), torch.ones(m), torch.ones(n))
        # without W8, prefill rows through the GEMM decoding the codes in its K loop (BONSAI_CODES_GEMM): both
        # of codes_default_config's prefill tiles
        tw = prepare(packed, scales, None if rotated else signs, codes=True)
        for m in (128, 512):
            ternary_linear(torch.randn(m, k, generator=g).bfloat16(), tw, rotated=rotated)
        # the per-token quantization in one pass (hadamard.one_pass_default takes it for down_proj), each row width
        hadamard.quantize_per_token(torch.randn(128, k, generator=g).bfloat16(), one_pass=True)
        # the dp4a route's rows on the fma GEMV as well (BONSAI_DP4A_GEMV=0; the default above took dp4a)
        tw = prepare(packed, scales, None if rotated else signs, dp4a=False)
        for m in (1, 2):
            ternary_linear(torch.randn(m, k, generator=g).bfloat16(), tw, rotated=rotated)


def drive_allreduce() -> None:
    from bonsai_vllm.comm.kernels import pack, unpack_sum

    for rows in (128, 2048):
        buf = pack(torch.randn(rows, 5120).bfloat16())
        unpack_sum(torch.stack([buf, buf]), (rows, 5120), out_dtype=torch.bfloat16)


def drive_kv() -> None:
    """K3V2 (and K2V2) store and decode at head_dim 256: the whole model's 24/4 heads and a rank's 12/2,
    one and two query positions, and a prefill row's sub-rows."""
    from bonsai_vllm.kv.kernels.decode import decode
    from bonsai_vllm.kv.format import K2V2, K3V2
    from bonsai_vllm.kv.paged import PagedK3V2
    from bonsai_vllm.kv.kernels.store import store

    bs = 2176  # the 27B's served K3V2 block at TP=2
    for fmt in (K3V2, K2V2):
        for hq, hkv in ((24, 4), (12, 2)):
            cache = torch.zeros(4, hkv, fmt.page_bytes(bs), dtype=torch.uint8)
            table = torch.arange(4, dtype=torch.int32)[None, :]
            kv = torch.randn(64, hkv, 256)
            store(cache, kv, kv, torch.arange(64), fmt, bs)
            for ql in (1, 2):
                win = torch.zeros(1, hkv, 132, 256, dtype=torch.bfloat16)
                decode(torch.randn(1, ql, hq, 256), cache, table, torch.tensor([4000], dtype=torch.int32),
                       win, win, torch.tensor([100], dtype=torch.int32), fmt, bs, 256 ** -0.5, q_start=4)
    g = PagedK3V2(K3V2, bs, guard=4)
    cache = torch.zeros(4, 2, g.page_bytes, dtype=torch.uint8)
    g.prefill_row(torch.randn(37, 12, 256), torch.randn(37, 2, 256), torch.randn(37, 2, 256), cache,
                  torch.arange(4, dtype=torch.int32), 4000, 256 ** -0.5, use_kernels=True)


def drive_dp4a() -> None:
    """Issue 19's decode GEMV (ternary.kernels.dp4a; drive_ternary reaches it at the default config): its prep
    and its GEMV with inline PTX dp4a, other tiles, one and several K slices, at every layer's shape; and
    every row count the kernel takes (1 to MAX_ROWS) at its default configuration."""
    from bonsai_vllm.ternary.kernels import dp4a

    g = torch.Generator().manual_seed(0)
    for name, (k, n) in LAYERS.items():
        packed = torch.randint(-2**31, 2**31 - 1, (n, k // 16), generator=g, dtype=torch.int32)
        scales = torch.rand(n, k // 128, generator=g).half() + 0.01
        act = dp4a.prepare(torch.randn(k, generator=g).bfloat16())
        for cfg in (dp4a.Dp4aConfig(bn=16, bw=32, warps=4, stages=2), dp4a.Dp4aConfig(bn=8, bw=16, warps=2, stages=3, split=4)):
            dp4a.gemv(act, packed, scales, cfg, dp4a.Dp4aWorkspace("cpu"))
        for rows in range(2, dp4a.MAX_ROWS + 1):
            act = dp4a.prepare(torch.randn(rows, k, generator=g).bfloat16())
            dp4a.gemv(act, packed, scales, dp4a.default_config(n, k, rows), dp4a.Dp4aWorkspace("cpu"))


DRIVERS = {"ternary": drive_ternary, "allreduce": drive_allreduce, "kv": drive_kv, "dp4a": drive_dp4a}

_RESOURCES = re.compile(r"REG:(?P<regs>\d+) STACK:(?P<stack>\d+) SHARED:(?P<shared>\d+) LOCAL:(?P<local>\d+)")


def cuobjdump() -> Path:
    """Triton's copy of cuobjdump (no CUDA toolkit needed)."""
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def dump_cubin(cubin: bytes, *flags: str) -> str:
    """cuobjdump's report on `cubin` with `flags` (e.g. "-sass", "--dump-resource-usage")."""
    import subprocess

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump()), *flags, f.name], capture_output=True, text=True, check=True).stdout


@dataclass(frozen=True)
class Resources:
    """What a one-kernel cubin (NVRTC's) asks of an SM, as cuobjdump reports it."""

    registers: int
    static_shared: int  # bytes; the launch adds its dynamic shared memory
    spill_bytes: int  # stack + local memory


def resources(cubin: bytes) -> Resources:
    m = _RESOURCES.search(dump_cubin(cubin, "--dump-resource-usage"))
    return Resources(int(m.group("regs")), int(m.group("shared")), int(m.group("stack")) + int(m.group("local")))


def compile_cuda(capability: int) -> list[Compiled]:
    """The CUDA C kernels (ternary/kernels/mma.cu, stream_gemv.cu, rotate_prep.cu), which NVRTC compiles at
    load: every instance the dispatch launches at the six layers' shapes (the rows of the mma route, y in bf16 and in float32 for a bias), as a
    cubin for `capability`; registers, stack (spills) and static shared memory read by Triton's cuobjdump, plus
    the dynamic shared memory each launch asks for (mma's pipeline stages, the stream GEMV's warp sums)."""
    from bonsai_vllm.ternary.kernels import linear, mma, rotate_prep, stream_gemv

    instances = {}  # template name -> (config, column tiles) (the K split is a launch argument, not part of it)
    gpu = mma.Gpu(capability, mma.RTX_5070.sms if capability // 10 == 12 else mma.H200.sms)  # the target's rule
    for k, n in LAYERS.values():
        for m in range(linear.DP4A_MAX_M + 1, linear.MMA_MAX_M + 1):
            config = mma.default_config(m, n, k, gpu)
            for dt in (torch.bfloat16, torch.float32):
                instances[mma.template(m, config, dt)] = (config, config.tiles(m))
    out = []
    for name, (config, tiles) in sorted(instances.items()):
        r = resources(mma.compile_instance(name, str(capability))[0])
        out.append(Compiled("ternary_mma", capability, config.threads() // 32, config.stages,
                            r.static_shared + config.shared_bytes(tiles), r.registers, r.spill_bytes, name))
    # the one-row streaming GEMV (its shared memory is dynamic: the warp sums of the largest row range, which
    # the RTX 5070's 48 SMs give)
    streams = {}
    for k, n in LAYERS.values():
        for rows in range(1, linear.STREAM_MAX_M + 1):
            config = stream_gemv.default_config(n, k, rows)
            if config is None:
                continue
            for dt in (torch.bfloat16, torch.float32):
                streams[stream_gemv.template(config, rows, k, dt)] = (config, rows, k, n)
    for name, (config, rows, k, n) in sorted(streams.items()):
        r = resources(stream_gemv.compile_instance(name, str(capability))[0])
        _, cap = stream_gemv.grid(config, n, k, 48, rows)
        out.append(Compiled("ternary_stream_gemv", capability, config.warps(k), 1,
                            r.static_shared + 4 * config.warps(k) * rows * cap, r.registers, r.spill_bytes, name))
    # the rotation + prep of unrotated decode rows (static shared memory only), at the rows per CTA it serves
    rows = rotate_prep.ROWS_DEFAULT
    name = rotate_prep.template(linear.BLOCK, rows, torch.bfloat16)
    r = resources(rotate_prep.compile_instance(name, str(capability))[0])
    out.append(Compiled("rotate_prep", capability, rows * linear.BLOCK // 256, 1, r.static_shared, r.registers,
                        r.spill_bytes, name))
    # the residual add + RMSNorm fused ahead of it (a CTA per row of the hidden width; with and without a residual,
    # with the rotation + prep and without, for rows on the other routes)
    k = LAYERS["gate_up"][0]
    for add in (True, False):
        for prep in (True, False):
            name = rotate_prep.norm_template(linear.BLOCK, k, torch.bfloat16, add, prep)
            r = resources(rotate_prep.compile_instance(name, str(capability))[0])
            out.append(Compiled("norm_rotate_prep", capability, k // 256, 1, r.static_shared, r.registers,
                                r.spill_bytes, name))
    return out


def run_target(cc: int) -> list[Compiled]:
    results: list[Compiled] = []
    for name, drive in DRIVERS.items():
        with compile_only(cc, results):
            drive()
    return results + compile_cuda(cc)


def run(targets: list[int]) -> list[Compiled]:
    """Each target in a process of its own where there are cores for it: the compiles are CPU-bound and the
    targets independent (two targets took 221 s one after the other on CI's two cores)."""
    if len(targets) == 1 or (os.cpu_count() or 1) == 1:
        return [c for cc in targets for c in run_target(cc)]
    # spawn: a fresh interpreter per target, not a fork of one whose Triton driver may already be patched
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(len(targets), os.cpu_count()), mp_context=spawn) as pool:
        return [c for part in pool.map(run_target, targets) for c in part]


def table(results: list[Compiled]) -> str:
    seen, lines = set(), ["| kernel | sm | warps | stages | shared KiB | registers | spill B | fits | constexprs |",
                          "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        key = (r.kernel, r.target, r.num_warps, r.num_stages, r.constexprs)
        if key in seen:
            continue
        seen.add(key)
        lines.append(f"| {r.kernel} | {r.target} | {r.num_warps} | {r.num_stages} | {r.shared / 1024:.1f} | "
                     f"{r.registers} | {r.spill_bytes} | {'yes' if r.fits else '**NO**'} | {r.constexprs[:80]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="90,120", help="compute capabilities, comma-separated")
    ap.add_argument("--json", metavar="FILE", help="also write every compiled kernel as JSON")
    args = ap.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("compile_check needs Triton", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check compiles for real GPUs: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    results = run([int(t) for t in args.targets.split(",")])
    print(table(results))
    bad = [r for r in results if not r.fits or r.registers < 0]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump([dict(asdict(r), fits=r.fits) for r in results], f, indent=1)
    print(f"\n{len(results)} launches compiled, {len({(r.kernel, r.target) for r in results})} kernel×target pairs; "
          f"{len(bad)} do not fit their target")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
