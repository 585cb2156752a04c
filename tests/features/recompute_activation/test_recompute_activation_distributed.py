"""recompute-activation-function in 2 gloo processes: TP=2+SP (dense, MoE), EP=2 MoE, PP=2
layer selection. One spawn runs every case (see recompute_activation_workers.suite)."""

from __future__ import annotations

import pytest

from mindspeed_like.testing import run_distributed
from mindspeed_like.testing.parity import SEED


@pytest.fixture(scope="module")
def suite():
    from recompute_activation_workers import suite as run_suite

    return run_distributed(run_suite, 2, SEED, timeout=300)


@pytest.mark.parametrize("case", ["tp2_sp", "tp2_sp_moe", "ep2_moe"])
def test_bitwise_equal_losses_with_and_without(suite, case):
    for rank in suite:
        assert rank[(case, False)] == rank[(case, True)], f"{case}: losses differ"
        assert rank[(case, False, "checkpoints")] == 0
        assert rank[(case, True, "checkpoints")] > 0


def test_each_pipeline_stage_recomputes_its_own_first_layers(suite):
    stage0, stage1 = (rank["pp2"] for rank in suite)
    assert stage0["global_numbers"] == [1, 2] and stage1["global_numbers"] == [3, 4]
    assert stage0["stage_numbers"] == stage1["stage_numbers"] == [1, 2]
    assert stage0["checkpoints"] == stage1["checkpoints"] == 1
