"""Issue 37 item 4: megatron-side readers of masters (Megatron-LM's ``--log-params-norm``) read the
true fp32 masters with reuse-fp32-param on (``features/reuse_fp32_param/readers.py``): inside
``readers.true_masters()`` every ``param.main_param`` equals the exact master (the optimizer's own
checkpoint path), outside it is the split layout (what the readers printed: nan with the Float16
optimizer, 0.000 at DP=2), and the bf16 weights are untouched afterwards. The run through
pretrain_gpt.py: tests/reliability/test_megatron_lm_params_norm.py."""

from __future__ import annotations

import pytest
import readers_workers as R
import reuse_fp32_workers as W

from mindspeed_like.testing import run_distributed


def _check(result: dict) -> None:
    assert W.equal(result["inside"], result["exact"])
    assert not W.equal(result["outside"], result["exact"]), "the split layout is what megatron's reader saw"
    assert W.equal(result["weights_after"], result["weights"])


def test_float16_optimizer_params_norm_reads_true_masters():
    _check(R.masters_read_by_megatron(False))


@pytest.mark.slow  # two processes; the opt-in pretrain_gpt.py test runs DP=2 as well
def test_distributed_optimizer_dp2_params_norm_reads_true_masters():
    for rank in run_distributed(R.masters_read_by_megatron, 2, True, timeout=300):
        _check(rank)
