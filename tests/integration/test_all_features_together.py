"""Every feature switched on at once on the real GPTModel at TP=2 + sequence parallel.

Each feature's own tests compare it alone with megatron's path; this is the combination a
user runs: flash attention, the three fused kernels, activation-function recompute and tiled
TP overlap together (plus grouped GEMM for a MoE model and shared bf16/fp32 storage in bf16).
Tolerances: fp32 1e-5 relative per step (each piece is within that alone; the overlap and the
recompute are exact); bf16 1e-3 relative at lr 1e-3 (fused kernels round once where megatron
rounds after every eager op, see test_fused_kernels_together.py); reuse-fp32-param is exact,
so adding it to the bf16 run must change nothing, bit for bit. The "on" runs are under
``strict``: a call any feature handed back to megatron would fail the run instead of passing
as megatron's own path.
"""

from __future__ import annotations

import pytest
from all_features_workers import BF16_ONLY, EXERCISED_ELSEWHERE, accelerations, switched_on

from mindspeed_like.testing import run_distributed


@pytest.fixture(scope="module")
def runs():
    from all_features_workers import all_features_tp2_sp

    return run_distributed(all_features_tp2_sp, 2, timeout=600)


def test_every_acceleration_is_exercised():
    """A new acceleration joins the shared runs through its ``switch_on``; one that megatron's
    config switches on instead must say in EXERCISED_ELSEWHERE which test combines it."""
    missing = [f.name for f in accelerations() if not f.switch_on and f.name not in EXERCISED_ELSEWHERE]
    assert not missing, (
        f"accelerations {missing} have no switch_on and no entry in all_features_workers.EXERCISED_ELSEWHERE: "
        "declare switch_on on the Feature, or name the test that runs them with the others"
    )
    stale = (set(BF16_ONLY) | set(EXERCISED_ELSEWHERE)) - {f.name for f in accelerations()}
    assert not stale, f"all_features_workers names features that do not exist: {sorted(stale)}"


def test_every_feature_was_on(runs):
    assert len(switched_on(bf16=False)) >= 7  # the registry was read, not an empty list
    for rank in runs:
        assert switched_on(bf16=False) <= rank["applied"], switched_on(bf16=False) - rank["applied"]
        assert switched_on(bf16=True) <= rank["applied_reuse"], switched_on(bf16=True) - rank["applied_reuse"]


def test_fp32_dense_and_moe_match_megatron(runs):
    for rank in runs:
        assert rank["dense_on"] == pytest.approx(rank["dense_off"], rel=1e-5)
        assert rank["moe_on"] == pytest.approx(rank["moe_off"], rel=1e-5)


def test_bf16_matches_and_reuse_fp32_param_changes_nothing(runs):
    for rank in runs:
        assert rank["bf16_on"] == pytest.approx(rank["bf16_off"], rel=1e-3)
        assert rank["bf16_on_reuse"] == rank["bf16_on"]
