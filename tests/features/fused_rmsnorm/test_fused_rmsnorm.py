"""Fused RMSNorm: kernel backends vs float64, the npu emulator's contract, megatron parity.

Tolerances (vs a float64 evaluation of the same formula, the largest error scaled by the largest
reference magnitude): mindspeed_like.testing.parity's table, fp32 1e-5 and bf16 2e-2.
- fp32: the fp32 kernels reduce ~hidden terms in float32 (relative error ~1e-7 * log n)
  and the backward subtracts two O(1) terms; 1e-5 leaves two orders of margin.
- bf16: outputs and grads. bf16 has 8 mantissa bits (relative step 2^-8 = 3.9e-3);
  the result is rounded to bf16 at least twice (normalized value, then times gamma), and
  weight grads sum many bf16-rounded products, so a few ulps are expected.
"""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch

import mindspeed_like
from mindspeed_like.kernels.backend import force_backend
from mindspeed_like.kernels.rmsnorm import rms_norm
from mindspeed_like.testing import (
    SavedBytesMeter,
    destroy_parallel,
    init_parallel,
    run_distributed,
    tiny_gpt,
    train_steps,
)
from mindspeed_like.testing.npu_emulator import ContractError, emulated_torch_npu
from mindspeed_like.testing.parity import SEED, assert_close_to_reference, assert_losses_close

SHAPES = [(2, 3, 64), (1, 1, 129), (5, 129), (7, 2, 3, 16)]
STEPS = 10


def _f64_reference(x, w, eps, zero_centered):
    xd = x.double()
    gamma = w.double() + (1 if zero_centered else 0)
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * gamma


def _run(x, w, g, eps=1e-5, zero_centered=False):
    """Forward and backward with the backend the ``kernel_backend`` fixture forced."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = rms_norm(x, w, eps, zero_centered)
    y.backward(g)
    return y, x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_backends_match_float64(kernel_backend, dtype, shape, zero_centered):
    torch.manual_seed(hash((kernel_backend.name, str(dtype), shape, zero_centered)) % 2**31)
    x = torch.randn(shape).to(dtype)
    w = (torch.rand(shape[-1]) * 0.5 + (0.0 if zero_centered else 0.75)).to(dtype)
    g = torch.randn(shape).to(dtype)
    xd = x.double().requires_grad_()
    wd = w.double().requires_grad_()
    yd = _f64_reference(xd, wd, 1e-5, zero_centered)
    yd.backward(g.double())
    y, dx, dw = _run(x, w, g, zero_centered=zero_centered)
    kernel_backend.assert_npu_calls("npu_rms_norm", 1)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    assert_close_to_reference(y, yd, dtype, what="y")
    assert_close_to_reference(dx, xd.grad, dtype, what="dx")
    assert_close_to_reference(dw, wd.grad, dtype, what="dw")


@pytest.mark.parametrize("kernel_backend", ["portable", "npu"], indirect=True)
def test_mixed_dtypes_and_leading_shapes(kernel_backend):
    """bf16 input with fp32 weight (result bf16 like torch.nn.RMSNorm), 1-D and 9-D inputs."""
    torch.manual_seed(0)
    for shape in [(129,), (1,) * 8 + (16,), (3, 4, 8)]:
        x = torch.randn(shape).bfloat16()
        w = torch.rand(shape[-1]) + 0.5
        y, dx, dw = _run(x, w, torch.randn(shape))
        expected = torch.nn.functional.rms_norm(x, (shape[-1],), w, 1e-5)
        assert y.dtype == expected.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16
        assert dw.dtype == torch.float32
        assert_close_to_reference(y, expected, torch.bfloat16, what=f"y {shape}")
    # fp32 input with a bf16 weight is not an npu pair: the kernel upcasts gamma.
    x, w = torch.randn(4, 32), (torch.rand(32) + 0.5).bfloat16()
    y, _, dw = _run(x, w, torch.randn(4, 32))
    assert dw.dtype == torch.bfloat16
    assert_close_to_reference(y, torch.nn.functional.rms_norm(x, (32,), w, 1e-5), torch.float32, what="fp32 x, bf16 w")


def test_portable_saves_only_x_and_rstd():
    rows, hidden = 64, 256
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, hidden, dtype=dtype, requires_grad=True)
        w = torch.ones(hidden, dtype=dtype, requires_grad=True)
        with SavedBytesMeter() as ours, force_backend("portable"):
            rms_norm(x, w)
        with SavedBytesMeter() as eager:
            torch.nn.functional.rms_norm(x, (hidden,), w, 1e-5)
        minimum = x.numel() * x.element_size() + rows * 4  # x + fp32 rstd
        assert ours.bytes == minimum and ours.count == 2
        assert eager.bytes > minimum


def test_emulator_rejects_wrong_calls():
    x, gamma = torch.randn(2, 3, 8), torch.ones(8)
    with emulated_torch_npu() as npu:
        out = npu.npu_rms_norm(x, gamma, epsilon=1e-6)
        assert isinstance(out, tuple) and len(out) == 2
        y, rstd = out
        assert rstd.dtype == torch.float32 and rstd.shape == (2, 3, 1) and y.dtype == x.dtype
        with pytest.raises(ContractError, match="suffix"):
            npu.npu_rms_norm(x, torch.ones(3))  # gamma not a suffix
        with pytest.raises(ContractError, match="2-8 dims"):
            npu.npu_rms_norm(torch.randn(8), gamma)
        with pytest.raises(ContractError, match="dtype pair"):
            npu.npu_rms_norm(x, gamma.bfloat16())  # fp32 input, bf16 gamma
        with pytest.raises(ContractError):
            npu.npu_rms_norm(x, gamma, eps=1e-6)  # wrong keyword (torch_npu calls it epsilon)
        with pytest.raises(ContractError):
            npu.npu_rms_norm(x, gamma, True)  # epsilon must be a float


# ---------------------------------------------------------------- megatron integration


@pytest.fixture
def adaptor():
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    yield
    destroy_parallel()
    mindspeed_like.reset()


def _train(flag: bool, steps: int = STEPS, **overrides) -> list[float]:
    mindspeed_like.configure(use_fused_rmsnorm=flag)
    init_parallel(seed=SEED)
    model = tiny_gpt(**overrides)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    from mindspeed_like.features.fused_rmsnorm import FusedRMSNorm

    assert len(norms) == 5  # 2 layers x 2 + final
    assert all(isinstance(m, FusedRMSNorm) == flag for m in norms)
    return train_steps(model, steps, seed=SEED)


def test_gpt_parity_fp32(adaptor):
    base = _train(False)
    fused = _train(True)
    assert_losses_close(fused, base, 1e-5, "fused-rmsnorm fp32 GPT")


@pytest.mark.slow
def test_gpt_parity_bf16(adaptor):
    """bf16: both paths round the normalized value to bf16 the same way, but the fp32 backward
    of ours differs from torch's bf16 chain in the last bits; 10 Adam steps amplify that a
    little. 1e-2 relative on the loss (~5.5) is far below what a wrong norm would give."""
    base = _train(False, bf16=True)
    fused = _train(True, bf16=True)
    assert all(math.isfinite(x) for x in fused)
    assert_losses_close(fused, base, 1e-2, "fused-rmsnorm bf16 GPT")


def test_state_dict_interchangeable_and_zero_centered(adaptor):
    mindspeed_like.configure(use_fused_rmsnorm=False)
    init_parallel(seed=SEED)
    plain = tiny_gpt()
    mindspeed_like.configure(use_fused_rmsnorm=True)
    init_parallel(seed=SEED)
    fused = tiny_gpt()
    assert plain.state_dict().keys() == fused.state_dict().keys()
    fused.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 256, (2, 32))
    positions = torch.arange(32).unsqueeze(0).expand(2, 32)
    torch.testing.assert_close(fused(tokens, positions, None), plain(tokens, positions, None), rtol=1e-5, atol=1e-5)

    zc = tiny_gpt(layernorm_zero_centered_gamma=True)  # megatron's torch norm asserts on this
    norm = zc.decoder.final_layernorm
    assert norm.zero_centered_gamma and torch.count_nonzero(norm.weight) == 0
    x = torch.randn(3, 2, 64)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (64,), None, norm.eps))


def test_recompute_and_npu_path_in_gpt(adaptor):
    """Selective ``layernorm`` recompute (CheckpointWithoutOutput around our module) and the
    npu backend (through the emulator) inside the real model: same losses as megatron's norm."""
    base = _train(False, steps=3)
    recomputed = _train(True, steps=3, recompute_granularity="selective", recompute_modules=["layernorm"])
    assert_losses_close(recomputed, base, 1e-5, "layernorm recompute")
    with emulated_torch_npu() as npu, force_backend("npu"):
        assert_losses_close(_train(True, steps=3), base, 1e-5, "npu backend")
    assert npu.calls["npu_rms_norm"] == 3 * 5  # steps x norms (one micro-batch per step)


def test_layernorm_config_untouched(adaptor):
    mindspeed_like.configure(use_fused_rmsnorm=True)
    init_parallel(seed=SEED)
    model = tiny_gpt(normalization="LayerNorm")
    assert type(model.decoder.final_layernorm) is torch.nn.LayerNorm


def test_flag_off_restores_megatron_objects(adaptor):
    from megatron.core.transformer import torch_norm

    original = inspect.getattr_static(torch_norm.WrappedTorchNorm, "__new__")
    mindspeed_like.configure(use_fused_rmsnorm=True)
    assert inspect.getattr_static(torch_norm.WrappedTorchNorm, "__new__") is not original
    mindspeed_like.configure(use_fused_rmsnorm=False)
    assert inspect.getattr_static(torch_norm.WrappedTorchNorm, "__new__") is original
    init_parallel(seed=SEED)
    assert type(tiny_gpt().decoder.final_layernorm) is torch.nn.RMSNorm


# ---------------------------------------------------------------- TP=2 + SP (one spawn)


def tp2_sp_worker(seed: int) -> dict:
    """Runs in each of 2 spawned processes: TP=2 + sequence parallel, flag off then on."""
    from mindspeed_like.features.fused_rmsnorm import FusedRMSNorm

    mindspeed_like.configure(device="cpu")
    out: dict = {}
    for flag in (False, True):
        mindspeed_like.configure(use_fused_rmsnorm=flag)
        init_parallel(tp=2, seed=seed)
        model = tiny_gpt(sequence_parallel=True)
        norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
        out[f"fused_{flag}"] = all(isinstance(m, FusedRMSNorm) == flag for m in norms)
        out[f"sp_marked_{flag}"] = all(getattr(m.weight, "sequence_parallel", False) for m in norms)
        out[f"losses_{flag}"] = train_steps(model, 5, seed=seed)
        destroy_parallel()
    return out


@pytest.mark.slow
def test_tp2_sequence_parallel_parity():
    results = run_distributed(tp2_sp_worker, 2, SEED, timeout=300)
    for rank in results:
        for flag in (False, True):
            assert rank[f"fused_{flag}"] and rank[f"sp_marked_{flag}"]
        assert_losses_close(rank["losses_True"], rank["losses_False"], 1e-5, "TP=2+SP")
    assert results[0]["losses_True"] == results[1]["losses_True"]


def test_module_is_a_torch_rmsnorm():
    from mindspeed_like.features.fused_rmsnorm import FusedRMSNorm

    ref = torch.nn.RMSNorm(48, eps=1e-6)
    fused = FusedRMSNorm.from_torch(copy.deepcopy(ref))
    assert list(fused.state_dict()) == ["weight"] and fused.normalized_shape == (48,) and fused.eps == 1e-6
    x = torch.randn(4, 48)
    torch.testing.assert_close(fused(x), ref(x))
