"""CUDA C compiled at run time by NVRTC, the runtime compiler that PyTorch's CUDA wheels carry.

The serving image has no nvcc and no CUDA toolkit (CUDA_HOME unset), so a CUDA C kernel of ours
(ternary/kernels/mma.cu, stream_gemv.cu) is compiled when a process first needs it, as Triton compiles its kernels:

    cubin, symbol = compile_cuda(source, "my_kernel<4, true>", arch="120")   # host only: any machine
    kernel = load(cubin, symbol, device)                                     # a GPU
    kernel(grid=(g, 1, 1), block=(128, 1, 1), args=[tensor, ..., 7])         # on the current stream
    launch(kernel, (g, 1, 1), (128, 1, 1), [tensor, ..., 7], early=True)     # may start before the kernel
                                                                             # ahead of it ends (sm_90+)
    launch(kernel, grid, block, [tensor, ..., tensor_map(codes, (32, 64), 128)])  # a TMA descriptor by value

`compile_cuda` needs no GPU (make compile-check compiles for sm_90 and sm_120 on CPU machines).
`torch.cuda._compile_kernel` does the same but insists on CUDA_HOME's headers, which the image lacks; the
kernels here include no headers. Loading and launching go through PyTorch's own driver wrappers.
"""

from __future__ import annotations

import ctypes
import functools

import torch


class NvrtcError(RuntimeError):
    pass


def _library() -> ctypes.CDLL:
    from torch.cuda._utils import _get_gpu_rtc_library  # libnvrtc.so.<CUDA major> as torch loads it

    return _get_gpu_rtc_library()


def compile_cuda(source: str, name: str, arch: str, options: tuple[str, ...] = (),
                 headers: dict[str, str] | None = None) -> tuple[bytes, str]:
    """Compile `source` for sm_`arch` (e.g. "90", "120"): the cubin and the lowered (mangled) symbol of
    `name`, a kernel or a template instance ("kernel<2, true>"). `headers`: include name -> text, for the
    source's `#include "name"` lines. A compile error raises NvrtcError with NVRTC's log."""
    lib = _library()
    error_string = lib["nvrtcGetErrorString"]  # a fresh function pointer: torch's own stays as it was
    error_string.restype = ctypes.c_char_p

    def check(code: int, what: str) -> None:
        if code:
            msg = error_string(code)
            raise NvrtcError(f"NVRTC {what}: {msg.decode() if msg else code}")

    prog = ctypes.c_void_p()
    headers = headers or {}
    texts = (ctypes.c_char_p * len(headers))(*(t.encode() for t in headers.values()))
    names = (ctypes.c_char_p * len(headers))(*(n.encode() for n in headers))
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", len(headers), texts, names),
          "create")
    try:
        check(lib.nvrtcAddNameExpression(prog, name.encode()), f"name {name!r}")
        opts = [f"--gpu-architecture=sm_{arch}".encode(), b"-std=c++17", *(o.encode() for o in options)]
        code = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        if code:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(f"NVRTC could not compile {name} for sm_{arch}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        lowered = ctypes.c_char_p()
        check(lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)), "lowered name")
        return cubin.raw, lowered.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def load(cubin: bytes, symbol: str, device: torch.device | int):
    """The kernel `symbol` of `cubin`, loaded into `device`'s context (call from any thread): a callable
    kernel(grid=, block=, args=[tensors and ints], shared_mem=0) launching on the current stream."""
    from torch.cuda._utils import _cuda_load_module

    with torch.cuda.device(device):
        return _cuda_load_module(cubin, [symbol])[symbol]


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def launch(kernel, grid: tuple[int, int, int], block: tuple[int, int, int], args: list, shared_mem: int = 0,
           early: bool = False) -> None:
    """Launch a `load`ed kernel on the current stream. `early`: as a programmatic dependent of the kernel ahead
    of it on the stream (cuLaunchKernelEx with programmatic stream serialization, sm_90 and later; captured
    into CUDA graphs as a programmatic edge): it may start once that kernel has called
    `griddepcontrol.launch_dependents` (triton_runtime.launch_dependents) and must `griddepcontrol.wait` before
    it reads anything that kernel writes. Without `early`, the kernel's own ordinary launch. Arguments: tensors
    (their data pointer), ints, and `bytes` (a struct passed by value, such as a `tensor_map`)."""
    if not early and not any(isinstance(a, bytes) for a in args):
        kernel(grid=grid, block=block, args=args, shared_mem=shared_mem)
        return
    from torch.cuda._utils import _get_gpu_runtime_library

    keep, params = [], []  # the argument values (kept alive until the call returns) and pointers to them
    for a in args:
        if isinstance(a, torch.Tensor):
            keep.append(ctypes.c_void_p(a.data_ptr()))
        elif isinstance(a, int):
            keep.append(ctypes.c_int(a))
        elif isinstance(a, bytes):
            keep.append((ctypes.c_char * len(a)).from_buffer_copy(a))
        else:
            raise TypeError(f"nvrtc.launch: argument of type {type(a).__name__}; tensors, ints and bytes only")
        params.append(ctypes.cast(ctypes.byref(keep[-1]), ctypes.c_void_p))
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    config = _LaunchConfig(*grid, *block, shared_mem, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                           ctypes.pointer(attr), 1 if early else 0)
    libcuda = _get_gpu_runtime_library()
    code = libcuda.cuLaunchKernelEx(ctypes.byref(config), kernel.func, (ctypes.c_void_p * len(params))(*params), None)
    if code:
        raise NvrtcError(f"cuLaunchKernelEx failed with CUresult {code}")


# cuTensorMapEncodeTiled's enums (cuda.h): CU_TENSOR_MAP_DATA_TYPE_UINT32, the swizzle per box row length in bytes
# (CU_TENSOR_MAP_SWIZZLE_32B / 64B / 128B), CU_TENSOR_MAP_L2_PROMOTION_L2_256B
_TENSOR_MAP_UINT32 = 2
_TENSOR_MAP_SWIZZLE = {32: 1, 64: 2, 128: 3}
_TENSOR_MAP_L2_256B = 3


@functools.lru_cache(maxsize=4096)
def _encode_tensor_map(address: int, rows: int, cols: int, row_bytes: int, box: tuple[int, int]) -> bytes:
    from torch.cuda._utils import _get_gpu_runtime_library

    libcuda = _get_gpu_runtime_library()
    encode = libcuda.cuTensorMapEncodeTiled
    encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    out = (ctypes.c_uint64 * 16)()  # CUtensorMap: 128 bytes, 64-byte aligned in the kernel's parameters
    code = encode(out, _TENSOR_MAP_UINT32, 2, ctypes.c_void_p(address), (ctypes.c_uint64 * 2)(cols, rows),
                  (ctypes.c_uint64 * 1)(row_bytes), (ctypes.c_uint32 * 2)(*box), (ctypes.c_uint32 * 2)(1, 1),
                  0, _TENSOR_MAP_SWIZZLE[4 * box[0]], _TENSOR_MAP_L2_256B, 0)
    if code:
        raise NvrtcError(f"cuTensorMapEncodeTiled failed with CUresult {code} (rows {rows}, columns {cols}, row "
                         f"stride {row_bytes} bytes, box {box}): the address and row stride must be multiples of 16 "
                         "bytes, and a box at most 256 × 256 elements with 32, 64 or 128-byte rows")
    return bytes(out)


def tensor_map(t: torch.Tensor, box: tuple[int, int]) -> bytes:
    """The TMA descriptor (CUtensorMap, 128 bytes, for `launch` by value) of a 2D tensor of 32-bit words on the
    GPU: boxes of box[0] words × box[1] rows, each box row's 16-byte chunks swizzled by its length (box[0] · 4 =
    32, 64 or 128 bytes: chunk c of row r lands at c ^ ((r / (8 / C)) % C), C chunks per row), rows past the
    tensor read as zeros. Encoded once per tensor address, shape and box (the driver call costs microseconds)."""
    if t.dim() != 2 or t.element_size() != 4 or t.stride(1) != 1:
        raise ValueError(f"nvrtc.tensor_map: a 2D tensor of 32-bit words, unit stride along a row; got "
                         f"{tuple(t.shape)} of {t.dtype}, strides {t.stride()}")
    return _encode_tensor_map(t.data_ptr(), t.shape[0], t.shape[1], 4 * t.stride(0), tuple(box))


_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def allow_shared(kernel, shared_mem: int, device_index: int = 0) -> None:
    """Opt a `load`ed kernel in to `shared_mem` bytes of dynamic shared memory per launch (above the 48 KB a
    launch gets by default; up to the device's per-block limit: 99 KB on sm_120, 227 KB on the H200)."""
    limit = torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin
    if shared_mem > limit:
        raise NvrtcError(f"a launch of {shared_mem} bytes of shared memory; this GPU allows {limit} per block")
    if hasattr(kernel, "set_shared_memory_config"):  # torch's wrapper: it also lifts its own 48 KB launch check
        kernel.set_shared_memory_config(shared_mem)
        return
    from torch.cuda._utils import _get_gpu_runtime_library

    code = _get_gpu_runtime_library().cuFuncSetAttribute(kernel.func, _MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                         ctypes.c_int(shared_mem))
    if code:
        raise NvrtcError(f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) failed with CUresult {code}")


def resident_ctas(kernel, threads: int, shared_mem: int = 0) -> int:
    """How many CTAs of `threads` threads (and `shared_mem` dynamic shared bytes) of a `load`ed kernel one SM of
    the current device holds at once (the driver's occupancy calculator: registers, shared memory, threads)."""
    from torch.cuda._utils import _get_gpu_runtime_library

    n = ctypes.c_int()
    code = _get_gpu_runtime_library().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(n), kernel.func, ctypes.c_int(threads), ctypes.c_size_t(shared_mem))
    if code:
        raise NvrtcError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUresult {code}")
    return n.value


def kernel_source(path) -> tuple[str, dict[str, str]]:
    """(source, headers) of a CUDA C file beside its folder's common.cuh, for compile_cuda."""
    from pathlib import Path

    path = Path(path)
    return path.read_text(), {"common.cuh": path.with_name("common.cuh").read_text()}


@functools.cache
def compile_file(path, name: str, arch: str) -> tuple[bytes, str]:
    """compile_cuda of the CUDA C file `path` (beside its folder's common.cuh): the cubin of the instance `name`
    for sm_`arch` and its lowered name, once per process. Host only (no GPU needed, any thread)."""
    source, headers = kernel_source(path)
    return compile_cuda(source, name, arch, headers=headers)


@functools.cache
def load_file(path, name: str, arch: str, device_index: int):
    """compile_file's instance loaded into a device's context, once per process."""
    return load(*compile_file(path, name, arch), device_index)


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    """The compute capability of a CUDA device (asked once per process)."""
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def sm_count(device_index: int) -> int:
    """The SMs of a CUDA device (asked once per process)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
