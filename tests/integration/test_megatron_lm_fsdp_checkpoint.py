"""Megatron-LM's pretrain_gpt.py with Megatron-FSDP's fsdp_dtensor checkpoints, 2 processes (opt-in).

Runs only when MEGATRON_LM_PATH points at a Megatron-LM checkout matching megatron-core. The iterations
after ``--load`` must print the uninterrupted run's lm loss and grad norm (dropout on: the RNG state is in
the checkpoint), and ``--load`` of a directory without a checkpoint must change nothing
(fix-megatron-fsdp-dtensor-checkpoint; docs/features/fsdp-checkpoints.md)."""

from __future__ import annotations

import pytest

from mindspeed_like.testing import megatron_lm

pytestmark = [pytest.mark.skipif(not megatron_lm.available(), reason=megatron_lm.SKIP_REASON), pytest.mark.slow]

MEGATRON_FSDP = [*megatron_lm.DROPOUT, *megatron_lm.MEGATRON_FSDP]


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_resume_prints_the_straight_runs_iterations(precision, tmp_path):
    straight, resumed, _ = megatron_lm.straight_and_resumed(2, [*MEGATRON_FSDP, *precision], str(tmp_path / "ckpt"))
    assert resumed == straight


MOE_EP2 = [
    *("--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-router-topk", "2"),
    *("--moe-token-dispatcher-type", "alltoall"),
    "--disable-bias-linear",  # megatron's experts with swiglu: "Bias is not supported for weighted swiglu fusion"
]


def test_moe_resume_at_ep2_prints_the_straight_runs_iterations(tmp_path):
    """DP 2 x EP 2 on 2 ranks (expert DP 1), fp32: Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` saves each
    EP rank's experts under their global index (``handle_experts_in_state_dict``), so the resume loads its own."""
    straight, resumed, _ = megatron_lm.straight_and_resumed(2, [*MEGATRON_FSDP, *MOE_EP2], str(tmp_path / "ckpt"))
    assert resumed == straight


def test_load_of_a_directory_without_a_checkpoint_changes_nothing(tmp_path):
    extra = [*MEGATRON_FSDP, "--bf16", "--train-iters", "3"]
    plain = megatron_lm.printed(megatron_lm.torchrun(2, megatron_lm.launcher(), extra))
    (tmp_path / "empty").mkdir()
    loaded = megatron_lm.printed(
        megatron_lm.torchrun(2, megatron_lm.launcher(), [*extra, "--load", str(tmp_path / "empty")])
    )
    assert loaded == plain
