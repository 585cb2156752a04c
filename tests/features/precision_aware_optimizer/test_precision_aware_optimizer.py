"""precision-aware-optimizer on the real megatron-core GPT: bf16 + DistributedOptimizer at DP=2
through megatron's own OptimizerConfig fields, against megatron's default path; skipped steps;
the TE checks and the reuse-fp32-param conflict."""

from __future__ import annotations

import pa_workers as W
import pytest
import torch

import mindspeed_like
from mindspeed_like.testing import run_distributed
from mindspeed_like.testing.parity import assert_losses_close, assert_losses_equal
from mindspeed_like.toolkit.errors import ConfigError

STEPS = 20
# Loss curves at lr 1e-2 on the tiny GPT memorizing one batch (5.5 -> 0.06 in 20 steps): the
# fp32-state curve is megatron's bit for bit; every other configuration changes the weights by
# bf16 ulps (remainders: ties round away from zero; bf16/fp8 moments: quantized m and v), which the
# model amplifies like any perturbation. Largest per-step relative difference measured over 20
# steps at DP=2: remainders 2.0e-3, bf16 moments 5.6e-3, fp8 moments 2.8e-2; bounds ~2-5x that.
RTOL = {"fp32+remainders": 1e-2, "bf16": 2e-2, "fp8": 6e-2}


def _check(curves: list[dict[str, list[float]]]) -> None:
    first = curves[0]
    for other in curves[1:]:
        assert other == first, "data-parallel ranks report different losses"
    assert_losses_equal(first["fp32"], first["megatron"], what="fp32 states vs megatron's default path")
    for name, rtol in RTOL.items():
        if name in first:
            assert_losses_close(first[name], first["fp32"], rtol, what=f"{name} vs fp32 states")
    assert first["fp32"][-1] < first["fp32"][0]  # it trains


@pytest.mark.slow
def test_gpt_dp2_fp32_states_equal_megatron_and_fp8_close():
    """Default lane: 10 steps (the 20-step run of every configuration is the slow case below)."""
    _check(run_distributed(W.curves, 2, 10, ("megatron", "fp32", "fp8"), timeout=600))


@pytest.mark.slow
def test_gpt_dp2_every_state_dtype():
    _check(run_distributed(W.curves, 2, STEPS, tuple(W.CURVES), timeout=900))


@pytest.mark.parametrize("moments", ["fp8", pytest.param("bf16", marks=pytest.mark.slow)])
def test_skipped_step_leaves_every_state_untouched(moments):
    out = W.skipped_step(moments)
    assert out["update_successful"] is False
    assert out["unchanged"], "a skipped step changed a weight, moment, remainder or block scale"
    assert out["steps"][0] == out["steps"][1]


def test_optimizer_config_without_te(cpu_config):
    """megatron's own check (TE import, is_te_min_version) passes; remainders stay as asked."""
    from megatron.core.optimizer import OptimizerConfig

    cpu_config()
    config = OptimizerConfig(
        optimizer="adam",
        bf16=True,
        use_distributed_optimizer=True,
        use_precision_aware_optimizer=True,
        exp_avg_dtype=torch.uint8,
        exp_avg_sq_dtype=torch.uint8,
        main_grads_dtype=torch.bfloat16,
    )
    assert config.store_param_remainders is True
    assert config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 is True
    assert config.optimizer_cpu_offload is False


def test_off_switch_gives_megatron_its_own_error(cpu_config):
    from megatron.core.optimizer import OptimizerConfig

    cpu_config(no_portable_precision_aware_optimizer=True)
    with pytest.raises((TypeError, RuntimeError)):
        OptimizerConfig(optimizer="adam", bf16=True, use_distributed_optimizer=True, use_precision_aware_optimizer=True)
    mindspeed_like.reset()


def test_reuse_fp32_param_conflict_names_both():
    with pytest.raises(ConfigError, match="--reuse-fp32-param.*--use-precision-aware-optimizer"):
        W.train("bf16", 1, grads="bf16", remainders=True, features={"reuse_fp32_param": True})
    from mindspeed_like.testing import destroy_parallel

    destroy_parallel()
    mindspeed_like.reset()


@pytest.mark.slow
@pytest.mark.parametrize("moments", ["fp32", "fp32+remainders", "bf16", "fp8"])
def test_checkpoint_round_trip_train3_save_load_train3_equals_train6(tmp_path, moments):
    """megatron's own checkpoint calls (state_dict + DP-zero parameter state through
    get_unscaled_state / set_scaled_state), loaded in fresh processes at DP=2: bit for bit."""
    saved = run_distributed(W.checkpoint_save, 2, str(tmp_path), moments, 3, 6, timeout=900)[0]
    resumed = run_distributed(W.checkpoint_load, 2, str(tmp_path), moments, 3, 6, timeout=900)[0]
    assert_losses_equal(saved["first"], saved["straight"][:3], what="first 3 steps")
    assert_losses_equal(resumed, saved["straight"][3:], what=f"{moments}: resumed steps 4-6 vs 6 straight")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("megatron", "bf16 moments, fp32 grads"),
        ("bf16 moments, fp32 grads", "fp32"),
        ("fp8 moments, fp32 grads", "fp32"),
        ("fp8", "bf16"),
    ],
)
def test_checkpoint_across_state_dtypes(tmp_path, source, target):
    """An fp32-state checkpoint (megatron's default path) continues with bf16 states, and a
    bf16/fp8-state one with fp32 states (same main-grads dtype: megatron's DP-zero file is keyed by
    it): the resumed curve stays within the bounds above of the source's own straight run."""
    saved = run_distributed(W.checkpoint_save, 2, str(tmp_path), source, 3, 6, timeout=900)[0]
    resumed = run_distributed(W.checkpoint_load, 2, str(tmp_path), target, 3, 6, timeout=900)[0]
    rtol = 6e-2 if "fp8" in source else 2e-2  # the bounds of the curves above
    assert_losses_close(resumed, saved["straight"][3:], rtol, what=f"{source} checkpoint resumed with {target} states")
