"""CUDA C compiled at run time by NVRTC, the runtime compiler that PyTorch's CUDA wheels carry.

The serving image has no nvcc and no CUDA toolkit (CUDA_HOME unset), so a CUDA C kernel of ours
(ternary/kernels/mma.cu) is compiled when a process first needs it, as Triton compiles its kernels:

    cubin, symbol = compile_cuda(source, "my_kernel<4, true>", arch="120")   # host only: any machine
    kernel = load(cubin, symbol, device)                                     # a GPU
    kernel(grid=(g, 1, 1), block=(128, 1, 1), args=[tensor, ..., 7])         # on the current stream

`compile_cuda` needs no GPU (make compile-check compiles for sm_90 and sm_120 on CPU machines).
`torch.cuda._compile_kernel` does the same but insists on CUDA_HOME's headers, which the image lacks; the
kernels here include no headers. Loading and launching go through PyTorch's own driver wrappers.
"""

from __future__ import annotations

import ctypes

import torch


class NvrtcError(RuntimeError):
    pass


def _library() -> ctypes.CDLL:
    from torch.cuda._utils import _get_gpu_rtc_library  # libnvrtc.so.<CUDA major> as torch loads it

    return _get_gpu_rtc_library()


def compile_cuda(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """Compile `source` for sm_`arch` (e.g. "90", "120"): the cubin and the lowered (mangled) symbol of
    `name`, a kernel or a template instance ("kernel<2, true>"). A compile error raises NvrtcError with
    NVRTC's log."""
    lib = _library()
    error_string = lib["nvrtcGetErrorString"]  # a fresh function pointer: torch's own stays as it was
    error_string.restype = ctypes.c_char_p

    def check(code: int, what: str) -> None:
        if code:
            msg = error_string(code)
            raise NvrtcError(f"NVRTC {what}: {msg.decode() if msg else code}")

    prog = ctypes.c_void_p()
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None), "create")
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
