"""fix-adam-state-without-step: torch's Adam behind megatron takes Adam states in TE's/apex's FusedAdam
layout (moments per parameter, the step count in the param group).

A checkpoint megatron writes with FusedAdam through its Float16 / FP32 optimizer holds the moments and
the groups' ``step`` and no per-parameter step (``common_step`` is saved only when the state has one):
loaded where megatron drives torch's Adam (no TE, no apex) it stopped with ``KeyError: 'step'``. Here
the FusedAdam layout is written into the running optimizer's state exactly as FusedAdam holds it (the
state megatron's dist_checkpointing tests write too), saved and loaded through megatron-core's
``dist_checkpointing``; the resumed step is checked against Adam's update in float64 with the
checkpoint's step count.
"""

from __future__ import annotations

import pytest
import torch
from optimizer_checkpoints import OLD_DISTOPT_NEEDS_NUMPY_1, build_gpt_and_optimizer, checkpoint_state, inner_states

from mindspeed_like.fixes import adam_state_without_step as fix

FUSED_ADAM_STEPS = 7


def _params(optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.optimizer.param_groups for p in g["params"]]


def _write_fused_adam_layout(optimizer, steps: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The inner optimizer's state as TE's FusedAdam holds it after ``steps`` steps."""
    inner = optimizer.optimizer
    moments = {}
    for group in inner.param_groups:
        group["step"] = steps
        for param in group["params"]:
            exp_avg, exp_avg_sq = torch.randn_like(param) * 1e-2, torch.rand_like(param) * 1e-4
            inner.state[param].update(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
            moments[len(moments)] = (exp_avg.clone(), exp_avg_sq.clone())
    return moments


def _save_fused_adam_checkpoint(tmp_path, fp16: bool):
    """What megatron with FusedAdam saves: megatron's own save (the fix off: its state_dict hook would
    give the saved states the count), of the state FusedAdam holds."""
    from megatron.core import dist_checkpointing

    from mindspeed_like import runtime

    runtime.ENGINE.remove(fix.NAME)
    model, optimizer = build_gpt_and_optimizer(fp16, False)
    moments = _write_fused_adam_layout(optimizer, FUSED_ADAM_STEPS)
    dist_checkpointing.save(checkpoint_state(model, optimizer, loading=False), str(tmp_path))
    runtime.apply()
    assert any(r.feature == fix.NAME and r.status == "applied" for r in runtime.ENGINE.report()), "on for the load"
    return moments


def _load(tmp_path, fp16: bool):
    from megatron.core import dist_checkpointing

    model, optimizer = build_gpt_and_optimizer(fp16, False)
    loaded = dist_checkpointing.load(checkpoint_state(model, optimizer, loading=True), str(tmp_path))
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    return model, optimizer


def _adam_in_float64(param, grad, exp_avg, exp_avg_sq, step: int, group: dict) -> torch.Tensor:
    """torch's AdamW update (decoupled weight decay, bias correction at ``step``) in float64."""
    beta1, beta2 = group["betas"]
    p, g = param.double(), grad.double()
    p = p * (1 - group["lr"] * group["weight_decay"])
    m = beta1 * exp_avg.double() + (1 - beta1) * g
    v = beta2 * exp_avg_sq.double() + (1 - beta2) * g * g
    m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
    return p - group["lr"] * m_hat / (v_hat.sqrt() + group["eps"])


@pytest.mark.parametrize("fp16", [pytest.param(True, id="float16-optimizer"), pytest.param(False, id="fp32-optimizer")])
def test_a_fused_adam_checkpoint_resumes_with_torch_adam(adaptor, tmp_path, fp16):
    from mindspeed_like.testing import init_parallel

    init_parallel()
    moments = _save_fused_adam_checkpoint(tmp_path, fp16)
    _, optimizer = _load(tmp_path, fp16)
    assert isinstance(optimizer.optimizer, (torch.optim.Adam, torch.optim.AdamW)), "not the case under test"
    states = inner_states(optimizer)
    assert len(states) == len(moments)
    for index, state in enumerate(states):
        assert float(state["step"]) == FUSED_ADAM_STEPS
        torch.testing.assert_close(state["exp_avg"], moments[index][0], rtol=0, atol=0)
        torch.testing.assert_close(state["exp_avg_sq"], moments[index][1], rtol=0, atol=0)
    # the groups' FusedAdam count moved into the states: it cannot go stale as torch's steps count on
    assert all("step" not in group for group in optimizer.optimizer.param_groups)


def test_the_resumed_step_corrects_the_bias_at_the_checkpoint_step(adaptor, tmp_path):
    """The first step after the load is Adam's step FUSED_ADAM_STEPS + 1 (float64 reference)."""
    from mindspeed_like.testing import init_parallel

    init_parallel()
    _save_fused_adam_checkpoint(tmp_path, fp16=False)
    model, optimizer = _load(tmp_path, fp16=False)
    inner = optimizer.optimizer
    before = [
        (p.detach().clone(), inner.state[p]["exp_avg"].clone(), inner.state[p]["exp_avg_sq"].clone())
        for p in _params(optimizer)
    ]
    generator = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=generator) * 1e-4 for p in _params(optimizer)]  # norm << clip_grad
    for param, grad in zip(_params(optimizer), grads):
        param.main_grad.copy_(grad)
    assert optimizer.step()[0]
    group = inner.param_groups[0]
    for param, grad, (p0, m0, v0) in zip(_params(optimizer), grads, before):
        assert float(inner.state[param]["step"]) == FUSED_ADAM_STEPS + 1
        expected = _adam_in_float64(p0, grad, m0, v0, FUSED_ADAM_STEPS + 1, group)
        torch.testing.assert_close(param.double(), expected, rtol=1e-6, atol=1e-7)


def test_without_the_fix_the_load_stops(adaptor, tmp_path):
    """megatron's own path: torch's Adam reads a ``step`` in every non-empty state it loads."""
    from mindspeed_like import runtime
    from mindspeed_like.testing import init_parallel

    init_parallel()
    _save_fused_adam_checkpoint(tmp_path, fp16=True)
    runtime.ENGINE.remove(fix.NAME)  # megatron's own load
    with pytest.raises(KeyError, match="step"):
        _load(tmp_path, fp16=True)


@pytest.mark.parametrize(
    "distributed_optimizer",
    [
        pytest.param(False, id="float16-optimizer"),
        pytest.param(True, id="distributed-optimizer", marks=OLD_DISTOPT_NEEDS_NUMPY_1),
    ],
)
def test_init_state_fn_states_step_and_save(adaptor, tmp_path, distributed_optimizer):
    """megatron's init_state_fn writes FusedAdam's state (moments, no step); torch's Adam then raised
    KeyError: 'step' at its next step, and the DistributedOptimizer's state_dict at the save (megatron's
    dist_checkpointing/test_optimizer.py initialises the state so before its save)."""
    from megatron.core import dist_checkpointing

    from mindspeed_like.testing import init_parallel

    init_parallel()
    model, optimizer = build_gpt_and_optimizer(True, distributed_optimizer)
    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        member.init_state_fn(member.optimizer)
    assert all(set(s) == {"exp_avg", "exp_avg_sq"} for s in inner_states(optimizer)), "not the case under test"
    dist_checkpointing.save(checkpoint_state(model, optimizer, loading=False), str(tmp_path))
    success, _, _ = optimizer.step()  # torch's Adam steps on the states init_state_fn made (step 0)
    assert success
    assert all(float(s["step"]) == 1.0 for s in inner_states(optimizer))


@OLD_DISTOPT_NEEDS_NUMPY_1
def test_stepless_moments_save_and_the_live_state_is_left_alone(adaptor, tmp_path):
    """Moments written in FusedAdam's layout without any count save with step 0 (KeyError: 'step' in the
    DistributedOptimizer's state_dict before), and the running optimizer's state is not changed by it."""
    from megatron.core import dist_checkpointing

    from mindspeed_like.testing import init_parallel

    init_parallel()
    model, optimizer = build_gpt_and_optimizer(False, True)
    inner = optimizer.optimizer
    for param in _params(optimizer):
        inner.state[param]["exp_avg"] = torch.rand_like(param)
        inner.state[param]["exp_avg_sq"] = torch.rand_like(param)
    assert all(float(s["step"]) == 0.0 for s in inner.state_dict()["state"].values())
    dist_checkpointing.save(checkpoint_state(model, optimizer, loading=False), str(tmp_path))
    assert all(set(state) == {"exp_avg", "exp_avg_sq"} for state in inner.state.values())


def test_torch_adam_states_are_left_as_they_are(adaptor):
    """A state torch's Adam made itself (it holds its step) is saved and loaded unchanged."""
    from mindspeed_like.testing import init_parallel

    init_parallel()
    _, optimizer = build_gpt_and_optimizer(False, False)
    inner = optimizer.optimizer
    for param in _params(optimizer):
        param.main_grad.copy_(torch.full_like(param, 1e-4))
    optimizer.step()
    saved = inner.state_dict()
    assert all(float(s["step"]) == 1.0 for s in saved["state"].values())
    steps = [inner.state[p]["step"] for p in _params(optimizer)]
    inner.load_state_dict(saved)
    assert [float(inner.state[p]["step"]) for p in _params(optimizer)] == [float(s) for s in steps]
