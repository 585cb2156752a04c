"""Issue 37 item 2 through Megatron-LM's own pretrain_gpt.py (opt-in): ``--optimization-level 2``
trains at each of megatron's precisions, saying once which features stepped aside and why.

Before the fix fp32 (megatron's default) and ``--fp16`` stopped at start-up with ``ConfigError:
--reuse-fp32-param needs bf16 ... drop --reuse-fp32-param``, a flag the user never typed. The
features that step aside are read from the registry (``Feature.precisions``), as in the
default-lane test tests/config/test_level_precisions.py. Dense model at each precision; a MoE
model (level 2's MoE features) in fp32 and fp16 is marked slow.
"""

from __future__ import annotations

import pytest

from mindspeed_like import levels, registry
from mindspeed_like.testing import megatron_lm

pytestmark = pytest.mark.skipif(not megatron_lm.available(), reason=megatron_lm.SKIP_REASON)

PRECISION_FLAGS = {
    "fp32": [],
    # megatron's default initial scale (2**32) skips the first ~20 iterations of this tiny model
    "fp16": ["--fp16", "--initial-loss-scale", "4096"],
    "bf16": ["--bf16"],
}
MOE = (
    "--num-experts 4 --moe-token-dispatcher-type alltoall --moe-router-topk 2 --moe-grouped-gemm --disable-bias-linear"
).split()
CASES = {
    **{f"dense-{p}": (p, []) for p in PRECISION_FLAGS},
    "moe-fp32": ("fp32", MOE),
    "moe-fp16": ("fp16", MOE),
}
SLOW = {"moe-fp32", "moe-fp16"}


def _cannot_act(precision: str) -> list[str]:
    members = levels.members(2, registry.all_features())
    return [f.name for f in members if f.precisions and precision not in f.precisions]


@pytest.mark.parametrize("case", [c if c not in SLOW else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_level_2_trains_at_every_precision_saying_what_stepped_aside(case):
    precision, model = CASES[case]
    output = megatron_lm.torchrun_output(
        1,
        megatron_lm.launcher(),
        ["--optimization-level", "2", *PRECISION_FLAGS[precision], *model, "--train-iters", "3"],
    )
    lines = megatron_lm.lines_of(output)
    assert len(megatron_lm.losses(lines, 3)) == 3
    said = [line for line in output.splitlines() if "stepped aside" in line]
    aside = _cannot_act(precision)
    assert len(said) == len(aside), said
    for name in aside:
        (line,) = [s for s in said if f"{name} (from --optimization-level 2) stepped aside" in s]
        assert f"this run trains in {precision}" in line, line
    on = {name.strip() for name in lines[0].split("features on:", 1)[1].split(",")}
    assert not on & set(aside)
    assert "fused-rmsnorm" in on and "recompute-activation-function" in on  # the rest of the level is on
