"""The compile lane (`make test-compile`): every acceleration with torch.compile ON.

Users run megatron with its ``jit_fuser`` = ``torch.compile``; the default lane disables dynamo
(TORCHDYNAMO_DISABLE=1) so that CPU timings are not dominated by compilation. Here it is on:
megatron's bias-SwiGLU and bias-dropout-add are compiled graphs, and each acceleration (read
from the registry, so a new one is included without editing this file) must give megatron's
numbers beside or instead of them: 5 steps at TP=2 + SP, feature alone and all together.

Tolerances: fp32 1e-5 relative per step (each feature's own bound in its parity tests); bf16
1e-3 (fused kernels round once where megatron rounds after every eager op: see
test_fused_kernels_together.py).
"""

from __future__ import annotations

import os

import pytest
import torch
from all_features_workers import EXERCISED_ELSEWHERE, accelerations, switched_on
from compile_workers import MODEL_FOR, MODELS

from mindspeed_like.testing import run_distributed
from mindspeed_like.testing.parity import assert_losses_close

pytestmark = pytest.mark.compile
RTOL = {"dense": 1e-5, "moe": 1e-5, "bf16": 1e-3}


@pytest.fixture(scope="module", autouse=True)
def compile_on():
    """The lane means nothing with dynamo off: fail instead of comparing eager with eager."""
    assert os.environ.get("TORCHDYNAMO_DISABLE", "0") in ("", "0") and not torch._dynamo.config.disable, (
        "the compile lane needs torch.compile on: run `make test-compile` (TORCHDYNAMO_DISABLE=0)"
    )


@pytest.fixture(scope="module")
def runs():
    from compile_workers import compile_parity

    return run_distributed(compile_parity, 2, timeout=1800)


def test_megatron_jit_fuser_was_compiled(runs):
    for rank in runs:
        assert rank["graphs"] > 0, "megatron's jit_fuser compiled nothing: dynamo was not on in the workers"


@pytest.mark.parametrize(
    "name", sorted(f.name for f in accelerations() if f.switch_on and f.name not in EXERCISED_ELSEWHERE)
)
def test_feature_matches_megatron_with_compile_on(runs, name):
    model = MODEL_FOR.get(name, "dense")
    for rank in runs:
        losses, applied = rank["feature"][name]
        assert name in applied
        assert_losses_close(losses, rank["baseline"][model], rtol=RTOL[model], what=f"{name} ({model}, compile on)")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_all_features_together_with_compile_on(runs, model):
    for rank in runs:
        losses, applied = rank["all"][model]
        assert switched_on(bf16=model == "bf16") <= applied
        assert_losses_close(
            losses, rank["baseline"][model], rtol=RTOL[model], what=f"all features ({model}, compile on)"
        )
