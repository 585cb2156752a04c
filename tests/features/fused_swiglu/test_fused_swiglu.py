"""Fused SwiGLU (``--use-fused-swiglu``): kernel backends vs float64, saved bytes, the
torch_npu emulator's contract, and megatron parity with the flag on vs off.

Tolerances (against a float64 reference of the same inputs, per element: the table of
mindspeed_like.testing.parity):
- fp32: rtol 1e-5 / atol 1e-6. The op is a few elementwise steps (sigmoid, two multiplies);
  each rounds once in fp32 (2^-24 relative), so errors stay within a few ulps.
- bf16: rtol 2e-2 / atol 2e-2 (bias grad: atol scaled by the token count). Outputs and grads
  are rounded to bf16 (2^-8 = 3.9e-3 relative) after 2-4 bf16 operations; values here are
  O(1), so 2e-2 is ~5 roundings. Megatron's own eager path has the same error.
Training parity: 10 steps, per-step losses within 1e-5 relative in fp32 (same math, only the
backward's elementwise association differs); bf16 within 1e-2 relative (bf16 rounding of
activations and grads amplified by 10 Adam steps).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import mindspeed_like
from mindspeed_like.kernels.backend import force_backend
from mindspeed_like.kernels.swiglu import swiglu, weighted_swiglu
from mindspeed_like.testing import (
    SavedBytesMeter,
    destroy_parallel,
    init_parallel,
    run_distributed,
    tiny_gpt,
    train_steps,
)
from mindspeed_like.testing.npu_emulator import ContractError, emulated_torch_npu
from mindspeed_like.testing.parity import SEED, assert_elementwise_close, assert_losses_close, tolerance

STEPS = 10
SHAPES = [(4, 3, 258), (1, 2, 64), (7, 129 * 2), (2, 1, 1, 10)]  # hidden 129 (halves), seq 1, 2-D, 4-D


def _run(backend, fn, args: tuple, grad: torch.Tensor) -> torch.Tensor:
    """Forward and backward under the ``kernel_backend`` fixture (npu: the contract-checking emulator)."""
    out = fn(*args)
    out.backward(grad.to(out.dtype))
    backend.assert_npu_calls("npu_swiglu", 1)
    return out


def _ref64(grad, x, bias=None, weights=None):
    x64 = x.detach().double().requires_grad_(True)
    b64 = None if bias is None else bias.detach().double().requires_grad_(True)
    w64 = None if weights is None else weights.detach().double().requires_grad_(True)
    y = x64 if b64 is None else x64 + b64
    a, b = y.chunk(2, dim=-1)
    out = F.silu(a) * b
    if w64 is not None:
        out = out * w64
    out.backward(grad.double())
    return out, x64.grad, None if b64 is None else b64.grad, None if w64 is None else w64.grad


def _close(actual, expected, dtype, what, atol_scale=1.0):
    """The table's per-element bound; a summed gradient's atol grows with the terms summed
    (``atol_scale``: sqrt(tokens) for a bias grad, 10 for a sum over 129 products)."""
    assert_elementwise_close(actual, expected, dtype, what=what, atol=tolerance(dtype).atol * atol_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_swiglu_matches_float64(kernel_backend, dtype, shape, with_bias):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kernel_backend.name, dtype, shape, with_bias)).encode()))
    x = torch.randn(shape, generator=gen).to(dtype).requires_grad_(True)
    bias = torch.randn(shape[-1], generator=gen).to(dtype).requires_grad_(True) if with_bias else None
    grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen)
    out = _run(kernel_backend, swiglu, (x, bias) if with_bias else (x,), grad)
    ref, gx, gb, _ = _ref64(grad, x, bias)
    assert out.dtype == dtype and out.shape == ref.shape
    _close(out, ref, dtype, "out")
    _close(x.grad, gx, dtype, "dx")
    if with_bias:
        tokens = x.numel() // shape[-1]
        _close(bias.grad, gb, dtype, "dbias", atol_scale=max(1.0, math.sqrt(tokens)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weighted_swiglu_matches_float64(kernel_backend, dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(33, 258, generator=gen).to(dtype).requires_grad_(True)
    w = torch.rand(33, 1, generator=gen).requires_grad_(True)  # fp32 probabilities, as in MoE
    grad = torch.randn(33, 129, generator=gen)
    out = _run(kernel_backend, weighted_swiglu, (x, w), grad)
    ref, gx, _, gw = _ref64(grad, x, weights=w)
    assert out.dtype == dtype
    _close(out, ref, dtype, "out")
    _close(x.grad, gx, dtype, "dx")
    _close(w.grad, gw, dtype, "dweights", atol_scale=10.0)  # a sum over 129 products


@pytest.mark.parametrize("kernel_backend", ["portable", "npu"], indirect=True)
@pytest.mark.parametrize("with_bias", [False, True])
def test_saves_only_the_input(kernel_backend, with_bias):
    x = torch.randn(16, 8, 256, requires_grad=True)
    bias = torch.randn(256, requires_grad=True) if with_bias else None
    with SavedBytesMeter() as meter:
        swiglu(x, bias)
    expected = x.nbytes + (bias.nbytes if with_bias and kernel_backend.name == "portable" else 0)
    # portable: x and bias (the biased sum is recomputed); npu: the biased input once.
    assert meter.bytes == expected, (meter.bytes, expected)
    with force_backend("reference"), SavedBytesMeter() as eager:
        swiglu(x, bias)
    assert eager.bytes >= 1.5 * x.nbytes  # megatron-style eager: a, b and silu(a)


def test_weighted_saves_input_and_weights():
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.rand(64, 1, requires_grad=True)
    with force_backend("portable"), SavedBytesMeter() as meter:
        weighted_swiglu(x, w)
    assert meter.bytes == x.nbytes + w.nbytes


def test_odd_last_dim_rejected():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(3, 5))


@pytest.mark.parametrize(
    "call",
    [
        lambda npu, x: npu.npu_swiglu(x[..., :-1].contiguous()),  # odd split dim
        lambda npu, x: npu.npu_swiglu(x.t()),  # not contiguous
        lambda npu, x: npu.npu_swiglu(x.double()),  # dtype
        lambda npu, x: npu.npu_swiglu(x, axis=-1),  # wrong keyword
        lambda npu, x: npu.npu_swiglu(x, dim=2),  # out of range
        lambda npu, x: npu.npu_swiglu(x, -1, 0),  # too many positionals
    ],
)
def test_emulator_rejects_wrong_calls(call):
    x = torch.randn(6, 8)
    with emulated_torch_npu() as npu, pytest.raises(ContractError):
        call(npu, x)


def test_emulator_accepts_documented_call():
    x = torch.randn(6, 8)
    with emulated_torch_npu() as npu:
        a, b = x.chunk(2, dim=0)
        torch.testing.assert_close(npu.npu_swiglu(x, dim=0), F.silu(a) * b)
        torch.testing.assert_close(npu.npu_swiglu(input=x), F.silu(x[:, :4]) * x[:, 4:])


# ---------------------------------------------------------------- megatron parity


def _losses(cpu_config, fused: bool, steps: int = STEPS, **model) -> list[float]:
    cpu_config(use_fused_swiglu=fused)
    init_parallel(seed=SEED)
    return train_steps(tiny_gpt(**model), steps, seed=SEED)


@pytest.mark.parametrize(
    "model",
    [
        {},  # inline GLU (bias_activation_fusion=False)
        {"add_bias_linear": True},  # inline GLU with the fc1 bias
        # megatron's bias_swiglu_impl; slow: the baseline torch.compiles megatron's fusion (~5 s)
        pytest.param({"bias_activation_fusion": True, "add_bias_linear": True}, marks=pytest.mark.slow),
    ],
    ids=["inline", "inline_bias", "fused_bias"],
)
def test_gpt_parity_fp32(cpu_config, model):
    base = _losses(cpu_config, False, **model)
    with emulated_torch_npu() as npu, force_backend("npu"):  # proves the route: our kernel runs
        routed = _losses(cpu_config, True, steps=1, **model)
    assert npu.calls["npu_swiglu"] > 0
    assert_losses_close(routed, base[:1], 1e-5, "npu route, step 0")
    ours = _losses(cpu_config, True, **model)
    assert_losses_close(ours, base, 1e-5, "fused-swiglu fp32 GPT")


@pytest.mark.slow
def test_gpt_parity_moe_sequential_fp32(cpu_config):
    model = dict(num_moe_experts=4, moe_token_dispatcher_type="alltoall")
    base = _losses(cpu_config, False, **model)
    ours = _losses(cpu_config, True, **model)
    assert_losses_close(ours, base, 1e-5, "fused-swiglu fp32 GPT")


@pytest.mark.slow
def test_gpt_parity_te_spec_grouped_experts_fp32(cpu_config):
    """The TE spec's grouped experts (TEGroupedMLP on the te-backend) compute their inline GLU
    through our weighted kernel, within 1e-5 of megatron's inline closure."""
    model = dict(transformer_impl="transformer_engine", num_moe_experts=4, moe_grouped_gemm=True)
    base = _losses(cpu_config, False, **model)
    with emulated_torch_npu() as npu, force_backend("npu"):  # the route: our weighted kernel runs
        _losses(cpu_config, True, steps=1, **model)
    assert npu.calls["npu_swiglu"] > 0
    ours = _losses(cpu_config, True, **model)
    assert_losses_close(ours, base, 1e-5, "fused-swiglu fp32 GPT, TE-spec grouped experts")


def test_gpt_parity_bf16(cpu_config):
    base = _losses(cpu_config, False, bf16=True)
    ours = _losses(cpu_config, True, bf16=True)
    assert_losses_close(ours, base, 1e-2, "fused-swiglu bf16 GPT")


@pytest.mark.parametrize("model", [{"gated_linear_unit": False}, {"activation_func": F.gelu}], ids=["gelu", "geglu"])
def test_other_activations_untouched(cpu_config, model, monkeypatch):
    import mindspeed_like.kernels.swiglu as kernel

    def boom(*args, **kwargs):
        raise AssertionError("fused swiglu used for a non-swiglu config")

    monkeypatch.setattr(kernel, "swiglu", boom)
    monkeypatch.setattr(kernel, "weighted_swiglu", boom)
    base = _losses(cpu_config, False, steps=2, **model)
    ours = _losses(cpu_config, True, steps=2, **model)
    assert ours == base


def test_wrapped_fusion_entry_points_use_our_kernel(cpu_config):
    """bias_swiglu_impl / weighted_bias_swiglu_impl, called as megatron calls them, run our op."""
    import megatron.core.fusions.fused_bias_swiglu as fused

    cpu_config(use_fused_swiglu=True)
    x = torch.randn(5, 3, 20)
    bias = torch.randn(20)
    w = torch.rand(15, 1)
    with emulated_torch_npu() as npu, force_backend("npu"):
        out = fused.bias_swiglu_impl(x, bias, False, False)
        weighted = fused.weighted_bias_swiglu_impl(x.view(15, 20), None, w, False)
    assert npu.calls["npu_swiglu"] == 2
    a, b = (x + bias).chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(a) * b)
    a, b = x.view(15, 20).chunk(2, dim=-1)
    torch.testing.assert_close(weighted, F.silu(a) * b * w)
    with pytest.raises(NotImplementedError):  # megatron's own error for a weighted call with a bias
        fused.weighted_bias_swiglu_impl(x.view(15, 20), bias, w, False)


def test_flag_off_restores_megatron_objects(cpu_config):
    import megatron.core.fusions.fused_bias_swiglu as fused
    import megatron.core.transformer.mlp as mlp
    import megatron.core.transformer.moe.experts as experts
    import megatron.core.transformer.moe.shared_experts as shared

    cpu_config()
    originals = (fused.bias_swiglu_impl, fused.weighted_bias_swiglu_impl, mlp.MLP.__dict__["forward"])
    mindspeed_like.configure(use_fused_swiglu=True)
    assert fused.bias_swiglu_impl is not originals[0]
    assert mlp.bias_swiglu_impl is fused.bias_swiglu_impl and shared.bias_swiglu_impl is fused.bias_swiglu_impl
    assert experts.weighted_bias_swiglu_impl is fused.weighted_bias_swiglu_impl
    assert mlp.MLP.__dict__["forward"] is not originals[2]
    mindspeed_like.configure(use_fused_swiglu=False)
    assert (fused.bias_swiglu_impl, fused.weighted_bias_swiglu_impl, mlp.MLP.__dict__["forward"]) == originals
    assert mlp.bias_swiglu_impl is originals[0] and shared.bias_swiglu_impl is originals[0]
    assert mlp.weighted_bias_swiglu_impl is originals[1] and experts.weighted_bias_swiglu_impl is originals[1]


# ---------------------------------------------------------------- TP=2 + SP (one spawn)


def tp2_sp_worker(seed: int = SEED) -> dict:
    from mindspeed_like.testing import init_parallel, tiny_gpt, train_steps

    out = {}
    for fused in (False, True):
        mindspeed_like.reset()
        mindspeed_like.configure(device="cpu", use_fused_swiglu=fused)
        init_parallel(tp=2, seed=seed)
        out[fused] = train_steps(tiny_gpt(sequence_parallel=True), STEPS, seed=seed)
        destroy_parallel()
    mindspeed_like.reset()
    return out


@pytest.mark.slow
def test_tp2_sp_parity():
    ranks = run_distributed(tp2_sp_worker, 2, SEED, timeout=300)
    for rank in ranks:
        assert_losses_close(rank[True], rank[False], 1e-5, "TP=2+SP")
