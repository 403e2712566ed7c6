"""Which route the vLLM adapter's ternary layer takes: the one `prepare` chose for it at load.

The layer is built as vLLM builds it (PrismTernaryLinearMethod.create_weights, weights filled in,
process_weights_after_loading) and called through `apply`, the custom op included. A spy on
`kernels.linear.route` records what each call would run where Triton runs (TRITON_INTERPRET=1 makes CPU tensors
count as such) and then lets the reference maths compute it, so no kernel runs here: whether the kernels compute
correctly is make gpu-check's job. Until 2026-12-02 the op rebuilt the layer's state from its tensors and lost
the dp4a configs, so served decode rows never took the dp4a route that gpu-check and the benchmarks timed.
"""

from __future__ import annotations

import pytest
import torch

from bonsai_vllm.ternary.format import encode_signs, pack_ternary
from bonsai_vllm.ternary.kernels import linear
from bonsai_vllm.ternary.reference import dequantize, signed_block_hadamard

N, K = 64, 1024  # the smallest shape the dp4a GEMV takes (K/16 a multiple of its 32-word step)


def _layer(spec):
    from bonsai_vllm.adapters.quantization import PrismTernaryLinearMethod

    method = PrismTernaryLinearMethod(spec, "model.layers.0.mlp.down_proj")
    layer = torch.nn.Module()
    method.create_weights(layer, K, [N], K, N, torch.bfloat16, weight_loader=lambda *a, **k: None)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-1, 2, (N, K), generator=gen)
    layer.weight.data.copy_(pack_ternary(codes))
    layer.scales.data.copy_((torch.rand(N, K // 128, generator=gen) + 0.5).half())
    method.process_weights_after_loading(layer)
    return method, layer


@pytest.fixture(scope="module", autouse=True)
def one_rank_world():
    """vLLM's parameters ask for the TP rank: a real one-rank vLLM world on gloo, gone afterwards (later
    in-process tests must see no process group)."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    from bonsai_vllm.testing.devserver import free_port

    from vllm.config import VllmConfig, set_current_vllm_config

    assert not dist.is_initialized()
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ps.initialize_model_parallel(1, backend="gloo")
        yield
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    assert not dist.is_initialized()


@pytest.fixture
def spec():
    from bonsai_vllm.ternary.format import PrismTernaryConfig

    signs = torch.where(torch.rand(K, generator=torch.Generator().manual_seed(1)) < 0.5, -1.0, 1.0)
    return PrismTernaryConfig.from_dict({"quant_method": "prism_ternary", "bits": 2, "group_size": 128,
                                         "hadamard_block": 1024, "signs": {str(K): encode_signs(signs)}})


@pytest.fixture
def routes(monkeypatch):
    """Every route `ternary_linear` picks, as (rows, Route) where Triton could run; the reference computes."""
    seen: list[tuple[int, linear.Route]] = []
    real = linear.route

    def spy(m, tw, triton_ok=True):
        seen.append((m, real(m, tw, True)))
        return linear.Route("reference")

    # patched where the adapter's ternary_linear looks it up (kernel test modules may load modules anew)
    from bonsai_vllm.adapters import quantization

    monkeypatch.setitem(quantization.ternary_linear.__globals__, "route", spy)
    return seen


def _expected(layer, x):
    xr = signed_block_hadamard(x.float(), layer.signs, 1024)
    return xr @ dequantize(layer.weight.data, layer.scales.data, 128).t()


def test_decode_rows_take_the_dp4a_route_prepare_chose(spec, routes, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton usable on these CPU tensors, as on CUDA ones
    from bonsai_vllm.adapters.quantization import PREPARED
    from bonsai_vllm.ternary.kernels import dp4a

    method, layer = _layer(spec)
    prepared = PREPARED[layer.prism_index]
    assert prepared.dp4a == tuple(dp4a.default_config(N, K, rows) for rows in range(1, linear.DP4A_MAX_M + 1))
    for m in (1, 2, 3, 200):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).bfloat16()
        y = method.apply(layer, x)
        torch.testing.assert_close(y.float(), _expected(layer, x), rtol=2e-2, atol=2e-2)
    paths = [(m, r.path, r.config) for m, r in routes]
    assert paths[0] == (1, "dp4a", prepared.dp4a[0])
    # two and more rows: the mma kernel on CUDA only (prepared.mma is None on CPU tensors), the GEMV here
    assert prepared.mma is None
    assert [(m, p) for m, p, _ in paths[1:]] == [(2, "gemv"), (3, "gemv"), (200, "int8")]


def test_dp4a_switched_off_keeps_the_gemv(spec, routes, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from bonsai_vllm import settings

    monkeypatch.setitem(settings._cache, "BONSAI_DP4A_GEMV", False)  # as BONSAI_DP4A_GEMV=0 read at start-up
    method, layer = _layer(spec)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(5)).bfloat16()
    torch.testing.assert_close(method.apply(layer, x).float(), _expected(layer, x), rtol=2e-2, atol=2e-2)
    assert [(m, r.path) for m, r in routes] == [(1, "gemv")]


def test_reference_where_triton_cannot(spec, routes, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU tensors, no interpreter (vLLM-CPU serving)
    from bonsai_vllm.adapters.quantization import PREPARED

    method, layer = _layer(spec)
    assert PREPARED[layer.prism_index].dp4a is None  # no workspace reserved for a route that cannot run
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(6)).bfloat16()
    torch.testing.assert_close(method.apply(layer, x).float(), _expected(layer, x), rtol=2e-2, atol=2e-2)


def test_weights_replaced_after_loading_are_refused(spec, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    method, layer = _layer(spec)
    layer.weight = torch.nn.Parameter(layer.weight.data.clone(), requires_grad=False)
    with pytest.raises(RuntimeError, match="moved after loading"):
        method.apply(layer, torch.randn(1, K).bfloat16())


# ---------------------------------------------------------------- BONSAI_FUSED_NORM (adapters/fused_norm.py)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_is_vllms_gemma_norm(dtype):
    # kernels.linear.rms_norm stands for vLLM's GemmaRMSNorm wherever the fused kernel does not run (and is the
    # yardstick of the kernel's own reference): it must be that module's arithmetic
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    gen = torch.Generator().manual_seed(3)
    norm = GemmaRMSNorm(K, eps=1e-6).to(dtype)
    norm.weight.data.copy_(0.1 * torch.randn(K, generator=gen))
    x = torch.randn(5, K, generator=gen).to(dtype)
    residual = (4 * torch.randn(5, K, generator=gen)).to(dtype)
    want, want_res = norm.forward_native(x.clone(), residual.clone())
    got, got_res = linear.rms_norm(x, residual, norm.weight.data, 1e-6, weight_offset=1.0)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got, none = linear.rms_norm(x, None, norm.weight.data, 1e-6, weight_offset=1.0)
    assert none is None and torch.equal(got, norm.forward_native(x.clone()))


def test_norm_op_is_the_norm_then_the_layer(spec, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from bonsai_vllm.adapters import fused_norm  # noqa: F401  (registers bonsai::norm_ternary_linear)

    method, layer = _layer(spec)
    gen = torch.Generator().manual_seed(9)
    weight = (0.1 * torch.randn(K, generator=gen)).bfloat16()
    for m in (1, 3, 70):
        x = torch.randn(m, K, generator=gen).bfloat16()
        residual = torch.randn(m, K, generator=gen).bfloat16()
        y, new_res = torch.ops.bonsai.norm_ternary_linear(x, residual, weight, 1e-6, 1.0, layer.weight,
                                                          layer.scales, layer.prism_index)
        normed, want_res = linear.rms_norm(x, residual, weight, 1e-6, weight_offset=1.0)
        assert torch.equal(new_res, want_res) and y.shape == (m, N)
        torch.testing.assert_close(y.float(), _expected(layer, normed), rtol=2e-2, atol=2e-2)
        # without a residual (vLLM's first decoder layer): the norm alone, then the layer
        y, empty = torch.ops.bonsai.norm_ternary_linear(x, None, weight, 1e-6, 1.0, layer.weight, layer.scales,
                                                        layer.prism_index)
        normed, _ = linear.rms_norm(x, None, weight, 1e-6, weight_offset=1.0)
        assert empty.numel() == 0
        torch.testing.assert_close(y.float(), _expected(layer, normed), rtol=2e-2, atol=2e-2)
    # the op checks the weights it is handed, as bonsai::ternary_linear does
    with pytest.raises(RuntimeError, match="moved after loading"):
        torch.ops.bonsai.norm_ternary_linear(x, residual, weight, 1e-6, 1.0, layer.weight.clone(), layer.scales,
                                             layer.prism_index)
