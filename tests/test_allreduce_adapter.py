"""Which int8 all-reduce the vLLM adapter runs: the Triton pack / unpack wherever Triton can run on the payload
(CUDA, or Triton's interpreter), the PyTorch reference elsewhere, vLLM's own all-reduce below the size
threshold. The adapter's custom op is called as vLLM calls it, with a one-rank gloo group standing in for the
TP group; spies on the two implementations record which one did the work (they pass the call on to the
PyTorch code, so no Triton kernel runs here: which kernels compute correctly is make gpu-check's job)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from bonsai_vllm.comm import reference as ref
from bonsai_vllm.comm import kernels


@pytest.fixture(scope="module")
def gloo_world():
    # this module's own one-rank world, gone afterwards (later in-process tests must see no process group)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def adapter(monkeypatch, gloo_world):
    from bonsai_vllm.adapters import allreduce as adapter

    calls: list[str] = []
    bf16_calls: list[torch.Tensor] = []
    group = types.SimpleNamespace(world_size=1, device_group=gloo_world,
                                  device_communicator=types.SimpleNamespace(
                                      all_reduce=lambda t: bf16_calls.append(t) or t))
    monkeypatch.setattr(adapter, "_group", lambda name: group)

    def spy(name, fn):
        def wrapped(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return wrapped

    # The Triton wrappers, standing in with the reference maths (same wire format). Patched in the module the
    # adapter's tp_all_reduce comes from: the kernel test modules make later imports load kernel modules anew.
    g = adapter.tp_all_reduce.__globals__
    monkeypatch.setitem(g, "pack", spy("triton pack", lambda x, **k: ref.pack(x)))
    monkeypatch.setitem(g, "unpack_sum", spy("triton unpack", lambda p, shape, out_dtype=torch.float32, **k:
                                             ref.unpack_sum(p, shape).to(out_dtype)))
    monkeypatch.setattr(g["ref"], "int8_all_reduce", spy("torch reference", ref.int8_all_reduce))
    return adapter, calls, bf16_calls


def _payload(rows: int) -> torch.Tensor:
    return torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows)).bfloat16()


def test_triton_where_triton_runs(adapter, monkeypatch):
    op, calls, bf16 = adapter
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton can run on CPU tensors: usable() is True
    x = _payload(256)
    assert kernels.route(x, 128) == kernels.ROUTE_TRITON
    y = op.int8_all_reduce_op(x, "tp:0", 128)  # route decided by the adapter's own module, spied above
    assert calls == ["triton pack", "triton unpack"] and not bf16
    # one rank: the sum is this rank's dequantized payload, within half an int8 step
    assert ((y.float() - x.float()).abs() <= ref.error_bound([x]) + x.float().abs() * 2 ** -8).all()


def test_reference_where_triton_cannot(adapter, monkeypatch):
    op, calls, bf16 = adapter
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU tensors, no interpreter (vLLM-CPU serving)
    x = _payload(256)
    assert kernels.route(x, 128) == kernels.ROUTE_TORCH
    op.int8_all_reduce_op(x, "tp:0", 128)
    assert calls == ["torch reference"] and not bf16


@pytest.mark.parametrize("rows", [1, 127])
def test_small_payloads_keep_vllms_all_reduce(adapter, monkeypatch, rows):
    op, calls, bf16 = adapter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = _payload(rows)
    assert kernels.route(x, 128) == kernels.ROUTE_BF16
    y = op.int8_all_reduce_op(x, "tp:0", 128)
    assert calls == [] and len(bf16) == 1 and torch.equal(y, x)


def test_width_not_a_multiple_of_128_keeps_vllms_all_reduce(adapter, monkeypatch):
    op, calls, bf16 = adapter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(256, 1000).bfloat16()
    op.int8_all_reduce_op(x, "tp:0", 128)
    assert calls == [] and len(bf16) == 1


def test_cuda_payloads_take_triton(monkeypatch):
    # the rule on a CUDA tensor, without the interpreter (on CPU a stand-in answers is_cuda like one)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():
        x = types.SimpleNamespace(is_cuda=True, numel=lambda: 256 * 5120, shape=(256, 5120))
    else:
        x = torch.empty(256, 5120, device="cuda", dtype=torch.bfloat16)
    assert kernels.route(x, 128) == kernels.ROUTE_TRITON
