"""Issue 37 item 4 through Megatron-LM's own pretrain_gpt.py (opt-in): ``--log-params-norm`` and
``--log-num-zeros-in-grad`` print megatron's values at ``--optimization-level 2`` (reuse-fp32-param
on), one process (Float16 optimizer) and DP=2 (DistributedOptimizer).

Before the fix the params norm was ``nan`` in one process and ``0.000`` at DP=2 every iteration,
against megatron's 18.763 (Megatron-LM's ``calc_params_l2_norm`` read ``param.main_param``, which
the feature keeps as bf16 + residual between steps: ``features/reuse_fp32_param/readers.py``).
megatron's values: the same run with ``--no-reuse-fp32-param`` (the feature trains bitwise as
megatron's layout, so the printed values are equal as strings). 3 iterations, 4 launches.
"""

from __future__ import annotations

import re

import pytest

from mindspeed_like.testing import megatron_lm

pytestmark = pytest.mark.skipif(not megatron_lm.available(), reason=megatron_lm.SKIP_REASON)

READERS = ["--log-params-norm", "--log-num-zeros-in-grad", "--optimization-level", "2", "--train-iters", "3"]
LAYOUTS = {"one-process": (1, ["--bf16"]), "dp2-distopt": (2, ["--use-distributed-optimizer", "--bf16"])}
PRINTED = re.compile(r"\| (params norm|num zeros|lm loss): ([^ |]+)")


def _printed(nproc: int, extra: list[str]) -> list[dict[str, str]]:
    lines = megatron_lm.torchrun(nproc, megatron_lm.launcher(), [*READERS, *extra])
    values = [dict(PRINTED.findall(line)) for line in lines[1:]]
    assert len(values) == 3 and all(len(v) == 3 for v in values), lines
    return values


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_params_norm_and_num_zeros_are_megatrons_at_level_2(layout):
    nproc, extra = LAYOUTS[layout]
    ours = _printed(nproc, extra)
    megatrons = _printed(nproc, [*extra, "--no-reuse-fp32-param"])
    for iteration, (got, expected) in enumerate(zip(ours, megatrons), start=1):
        assert got == expected, f"{layout}: iteration {iteration} printed {got}, megatron's path {expected}"
    assert float(ours[0]["params norm"]) > 1.0
