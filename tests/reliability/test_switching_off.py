"""Issue 15, item 1: switching reuse-fp32-param off (or reset()) while an optimizer built with it
is alive never corrupts it: a Float16 optimizer goes back to megatron's own layout exactly; a
DistributedOptimizer makes the switch a ConfigError that says how to proceed."""

from __future__ import annotations

import gc

import pytest
import torch

import mindspeed_like
from mindspeed_like.testing import init_parallel, make_batches, run_distributed, tiny_gpt, train_steps
from mindspeed_like.testing.parity import SEED
from mindspeed_like.toolkit.errors import ConfigError

STEPS = 3


def _train(reuse: bool, **train_args):
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", reuse_fp32_param=reuse)
    init_parallel(seed=SEED)
    model = tiny_gpt(bf16=True)
    box: dict = {}
    data = make_batches(STEPS + 1, 2, 32, 256, SEED)
    train_steps(
        model,
        STEPS,
        seed=SEED,
        data=data[:STEPS],
        lr=1e-2,
        on_optimizer=lambda m, o: box.update(m=m, o=o),
        **train_args,
    )
    return box["m"], box["o"], data[STEPS]


def _inner(optimizer):
    """megatron's optimizer inside its ChainedOptimizer."""
    (inner,) = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return inner


def _masters(optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for group in _inner(optimizer).fp32_from_float16_groups for p in group]


def _one_more_step(model, optimizer, batch) -> float:
    tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens, positions, None, labels=labels).float().mean()
    loss.backward()
    model.finish_grad_sync()
    optimizer.step()
    return loss.item()


@pytest.mark.parametrize("how", ["configure", "reset"])
def test_float16_optimizer_goes_back_to_megatrons_layout_exactly(how):
    model, opt, batch = _train(reuse=False)
    expected_masters = _masters(opt)
    expected_loss = _one_more_step(model, opt, batch)
    expected_weights = [p.detach().clone() for p in model.parameters()]
    del model, opt

    model, opt, batch = _train(reuse=True)
    if how == "configure":
        mindspeed_like.configure(reuse_fp32_param=False)
    else:
        mindspeed_like.reset()
        mindspeed_like.configure(device="cpu")
    masters = _masters(opt)
    assert all(torch.isfinite(m).all() for m in masters)
    assert all(torch.equal(a, b) for a, b in zip(masters, expected_masters))
    state = _inner(opt).state_dict()  # what a checkpoint would save: megatron's own code path now
    assert all(torch.isfinite(t).all() for g in state["fp32_from_fp16_params"] for t in g)
    assert _one_more_step(model, opt, batch) == expected_loss
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected_weights))
    mindspeed_like.reset()


def _distributed_refuses() -> dict:
    model, opt, _ = _train(reuse=True, use_distributed_optimizer=True)
    out = {}
    try:
        mindspeed_like.configure(reuse_fp32_param=False)
    except ConfigError as error:
        out["configure"] = str(error)
    out["still_on"] = mindspeed_like.current_config()["reuse_fp32_param"]
    try:
        mindspeed_like.reset()
    except ConfigError as error:
        out["reset"] = str(error)
    del model, opt
    gc.collect()
    mindspeed_like.configure(reuse_fp32_param=False)  # no live optimizer: the switch goes through
    out["off"] = not mindspeed_like.current_config()["reuse_fp32_param"]
    mindspeed_like.reset()
    return out


@pytest.mark.slow
def test_live_distributed_optimizer_refuses_the_switch_and_says_how():
    """DP=2 (at DP=1 the feature keeps megatron's layout for a DistributedOptimizer)."""
    out = run_distributed(_distributed_refuses, 2, timeout=300)[0]
    assert "cannot be switched off while 1 DistributedOptimizer(s) built with it are alive" in out["configure"]
    assert "Save a checkpoint now" in out["configure"]
    assert out["still_on"] is True
    assert "DistributedOptimizer" in out["reset"]
    assert out["off"] is True


def test_switching_on_after_the_optimizer_exists_is_said_not_silent(caplog):
    model, opt, batch = _train(reuse=False)
    mindspeed_like.configure(reuse_fp32_param=True)
    _one_more_step(model, opt, batch)
    assert "was built before --reuse-fp32-param was switched on and keeps megatron's separate fp32 masters" in (
        caplog.text
    )
    mindspeed_like.reset()


def _norm_types(model) -> set[str]:
    return {type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__}


@pytest.mark.parametrize("first, then", [(False, True), (True, False)], ids=["on-later", "off-later"])
def test_construction_time_feature_switched_after_the_model_exists_is_said(first, then, caplog):
    """fused-rmsnorm picks the norm module when a layer is built: switching it afterwards leaves
    the existing model as it is, which the user is told (and refused under strict)."""
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", use_fused_rmsnorm=first)
    init_parallel(seed=SEED)
    model = tiny_gpt(normalization="RMSNorm")
    before = _norm_types(model)
    with caplog.at_level("WARNING", logger="mindspeed_like"):
        mindspeed_like.configure(use_fused_rmsnorm=then)
    assert _norm_types(model) == before  # the model keeps what it was built with ...
    state = "on" if then else "off"
    assert f"fused-rmsnorm: switched {state} for models built from now on (switched {state} while 1 megatron" in (
        caplog.text
    )  # ... and the user is told so
    assert "keep its RMSNorm modules" in caplog.text
    assert "build the model after configure()" in caplog.text
    # a model built now follows the switch, without a word
    caplog.clear()
    del model
    rebuilt = tiny_gpt(normalization="RMSNorm")
    assert "fused-rmsnorm" not in caplog.text
    assert ("FusedRMSNorm" in _norm_types(rebuilt)) is then
    mindspeed_like.configure(strict=True)
    refused = r"fused-rmsnorm switched \w+ while 1 megatron model\(s\) exist.*strict is on"
    with pytest.raises(ConfigError, match=refused):
        mindspeed_like.configure(use_fused_rmsnorm=first)
    assert mindspeed_like.current_config()["use_fused_rmsnorm"] is then  # refused: nothing changed
    mindspeed_like.reset()  # the state of a fresh import: it knows of no model built before
    mindspeed_like.configure(device="cpu", strict=True, use_fused_rmsnorm=first)
    assert mindspeed_like.current_config()["use_fused_rmsnorm"] is first
    mindspeed_like.reset()
