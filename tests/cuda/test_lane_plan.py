"""`mindspeed-like plan`'s device rows against the real model on the lane's device (issue 38): the
parameters megatron builds and the bytes one training forward saves for backward, for megatron's own
path and the levels, with megatron's default dropout and without. On a CPU the plan's rows were
read off the real model (tests/plan/test_plan_parity.py); on CUDA the device's kernels decide what
is kept (``native_dropout``'s bool mask, SDPA's flash kernel keeping its RNG state instead of a
mask, megatron's own attention softmax), and this is where those rows are measured."""

from __future__ import annotations

import pytest
import torch
from cuda_lane import MEASURED

from mindspeed_like.testing import models, plan_parity

pytestmark = pytest.mark.cuda

CASES = [
    ("llama", "transformer_engine", 0),
    ("llama", "transformer_engine", 1),
    ("llama", "transformer_engine", 2),
    ("llama", "local", 0),
    ("llama", "local", 1),
    ("gpt", "transformer_engine", 0),
    ("gpt", "transformer_engine", 2),
    ("moe", "transformer_engine", 0),
    ("moe", "transformer_engine", 2),
    ("qwen3-moe", "transformer_engine", 0),
    ("qwen3-moe", "transformer_engine", 2),
    ("deepseek", "transformer_engine", 0),
    ("deepseek", "transformer_engine", 2),
]


@pytest.fixture
def as_users_run(lane_device):
    """The lane's deterministic algorithms off for the measurement: megatron's MoE takes another
    branch under them (``torch.are_deterministic_algorithms_enabled()``), which saves other tensors
    than a user's run does (measured on the CPU self-check: 199,680 bytes more at level 0)."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield lane_device
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no-dropout", "dropout"])
@pytest.mark.parametrize(("preset", "impl", "level"), CASES, ids=lambda v: str(v))
def test_plan_saved_bytes_on_the_device(as_users_run, preset, impl, level, dropout, monkeypatch, request):
    monkeypatch.setitem(models.DEFAULTS, "hidden_dropout", dropout)
    monkeypatch.setitem(models.DEFAULTS, "attention_dropout", dropout)
    lane_device = as_users_run
    args = plan_parity.compare_options(preset, impl)
    plan_params, plan_saved = plan_parity.predicted(args, level, dropout, lane_device.type)
    built, saved = plan_parity.measured(args, level, lane_device)
    error = plan_saved / saved - 1
    bound = plan_parity.bound(preset, impl, level, lane_device.type)  # 1%: every saved storage is a row
    MEASURED[request.node.name] = dict(predicted_bytes=plan_saved, measured_bytes=saved, error=error, bound=bound)
    assert plan_params == built, f"plan {plan_params} parameters, megatron built {built}"
    assert abs(error) <= bound, (
        f"{preset}/{impl}/level {level}/dropout {dropout} on {lane_device.type}: plan {plan_saved} bytes saved "
        f"for backward, measured {saved} ({100 * error:+.2f}%)"
    )
    if lane_device.type == "cuda":
        torch.cuda.empty_cache()
