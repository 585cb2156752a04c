"""The stand-in Adam over Megatron-FSDP chunks holds what TE's FusedAdam holds there.

megatron-core 0.18+'s ``get_megatron_optimizer`` turns FusedAdam's ``master_weights`` off over
Megatron-FSDP (the main-weight buffer, or the weight shard under ``auto``, is what it steps) and makes
its gradients decoupled, keyed on ``not USING_PYTORCH_OPTIMIZER``: True on a host without TE or Apex, so
our Adam kept an int16 remainder (2 B an element) beside bf16 main params that TE's would not. No spawn:
``BuildOptimizer`` around a build that returns our Adam, as megatron's does."""

from __future__ import annotations

from types import SimpleNamespace

import megatron.core.optimizer  # noqa: F401 - the module BuildOptimizer swaps names in
import pytest
import torch

from mindspeed_like.features.precision_aware_optimizer.optimizer import BuildOptimizer, clears_fsdp_master_weights
from mindspeed_like.kernels.adam import PrecisionAwareAdam

pytestmark = pytest.mark.skipif(
    not clears_fsdp_master_weights(),
    reason="megatron-core < 0.18 keeps the Adam's masters over Megatron-FSDP (precision-aware there refused by plan)",
)

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def _build(param: torch.Tensor, use_megatron_fsdp: bool):
    def build(config, model_chunks):  # megatron's _get_megatron_optimizer_based_on_param_groups, reduced
        adam = PrecisionAwareAdam(
            [param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master_weights=True,
            use_decoupled_grad=True, store_param_remainders=True,
        )  # fmt: skip
        return SimpleNamespace(optimizer=adam)

    config = SimpleNamespace(use_precision_aware_optimizer=True)
    chunk = SimpleNamespace(ddp_config=SimpleNamespace(use_megatron_fsdp=use_megatron_fsdp))
    return BuildOptimizer()(build, None, (), {"config": config, "model_chunks": chunk}).optimizer


def _reference(w: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """AdamW in float64 on the bf16 weight itself, rounded to bf16 after every step (no master)."""
    w = w.double()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        w = w * (1 - LR * WD)
        w = w - LR * (m / (1 - BETAS[0] ** t)) / ((v / (1 - BETAS[1] ** t)).sqrt() + EPS)
        w = w.to(torch.bfloat16).double()
    return w


def test_no_masters_of_its_own_over_megatron_fsdp():
    torch.manual_seed(0)
    w0 = torch.randn(1000).to(torch.bfloat16)
    grads = [torch.randn(1000).to(torch.bfloat16) for _ in range(3)]
    param = torch.nn.Parameter(w0.clone())
    adam = _build(param, use_megatron_fsdp=True)
    assert adam.master_weights is False and adam.use_decoupled_grad is True
    for g in grads:
        param.decoupled_grad = g.clone()
        adam.step()
    assert set(adam.state[param]) == {"exp_avg", "exp_avg_sq"}  # no int16 remainders, as TE's
    held = sum(t.numel() * t.element_size() for t in adam.state[param].values())
    assert held == 2 * 4 * 1000  # fp32 moments only
    ref = _reference(w0, grads)
    assert torch.allclose(param.detach().double(), ref, rtol=2**-7, atol=0)


def test_masters_kept_outside_megatron_fsdp():
    param = torch.nn.Parameter(torch.randn(1000).to(torch.bfloat16))
    adam = _build(param, use_megatron_fsdp=False)
    param.decoupled_grad = torch.randn(1000).to(torch.bfloat16)
    adam.step()
    assert adam.master_weights is True
    assert adam.state[param]["master_param"].dtype == torch.int16
