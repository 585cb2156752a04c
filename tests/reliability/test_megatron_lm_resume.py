"""Issue 28, items 1, 2, 3 and 8 through Megatron-LM's own pretrain_gpt.py (opt-in).

A run saved and loaded in NEW processes goes on exactly as if it never stopped: Megatron-LM's
``pretrain_gpt.py`` (the one import line, through ``python -m mindspeed_like.run``), 2 processes,
DP=2, Megatron-LM's default ``--ckpt-format torch_dist``. Each case trains 6 iterations straight;
then 3 that save and exit at iteration 3 (``--save-interval 3 --exit-interval 3``, the same
``--train-iters 6``: the learning-rate schedule is the straight run's), and a new ``torchrun``
loads them (``--load``) and trains to 6. Iterations 4-6 print the same ``lm loss`` AND ``grad
norm`` as the straight run, compared as the printed strings (digit for digit).

* item 1 (``fixes/distopt_padding_flag.py``): the precision-aware optimizer (bf16 moments; fp8
  moments; bf16 main grads) with the DistributedOptimizer: the load died with ``KeyError:
  'padding'`` before the fix (megatron-core < 0.17).
* item 2 (``fixes/decoupled_lr_resume.py``): ``--decoupled-lr`` resumed at the wrong learning rate
  (DistributedOptimizer) or did not load (Float16 optimizer) on megatron-core 0.16-0.18.
* item 8 (``fixes/training_log_first_iteration.py``): iteration 5 of every resumed run printed
  the mean of iterations 4 and 5; each case below compares iteration 5 too.
* item 3: ``--optimization-level 2`` resumes exactly with every level-2 feature on; with
  megatron's ``--use-precision-aware-optimizer`` reuse-fp32-param steps aside (one log line)
  instead of failing; ``--no-reuse-fp32-param`` keeps the level without it.

Runs only when MEGATRON_LM_PATH points at a Megatron-LM checkout whose tag matches megatron-core
(core_v0.16.1 for 0.16.1); see docs/megatron-lm.md. Each resume case is three 2-process runs
(about 1-3 minutes on a 2-core CPU): marked slow.
"""

from __future__ import annotations

import pytest

from mindspeed_like import registry
from mindspeed_like.testing import megatron_lm

pytestmark = pytest.mark.skipif(not megatron_lm.available(), reason=megatron_lm.SKIP_REASON)

ITERS, SAVE_AT = 6, 3
RESUMED = list(range(SAVE_AT + 1, ITERS + 1))
DISTOPT_BF16 = ["--use-distributed-optimizer", "--bf16"]
DECOUPLED = ["--decoupled-lr", "5e-4", "--decoupled-min-lr", "4.5e-5"]
PRECISION_AWARE = ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"]
STEPPED_ASIDE = "reuse-fp32-param (from --optimization-level 2) stepped aside: --use-precision-aware-optimizer"

CASES = {
    # item 8 alone: the default DistributedOptimizer bf16 run (iteration 5 was a mean of two)
    "distopt-bf16": DISTOPT_BF16,
    # item 1
    "precision-aware-bf16-moments": [
        *DISTOPT_BF16, *PRECISION_AWARE, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
    ],
    "precision-aware-fp8-moments": [
        *DISTOPT_BF16, *PRECISION_AWARE, "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp8",
    ],
    # item 2
    "decoupled-lr-distopt": [*DISTOPT_BF16, *DECOUPLED],
    "decoupled-lr-float16-optimizer": ["--bf16", *DECOUPLED],
    # item 3: every level-2 feature (reuse-fp32-param needs --bf16)
    "optimization-level-2": [*DISTOPT_BF16, "--optimization-level", "2"],
}  # fmt: skip


def _run(extra: list[str], iters: int = ITERS) -> list[str]:
    return megatron_lm.torchrun(2, megatron_lm.launcher(), [*extra, "--train-iters", str(iters)])


def straight_and_resumed(extra: list[str], checkpoint: str) -> tuple[dict, dict, list[str]]:
    """Iterations 4-6 as printed by the straight run and by the resumed one, and the resumed
    run's lines (its "features on" line first)."""
    straight = megatron_lm.printed(_run(extra))
    assert sorted(straight) == list(range(1, ITERS + 1))
    first = megatron_lm.printed(
        _run([*extra, "--save", checkpoint, "--save-interval", str(SAVE_AT), "--exit-interval", str(SAVE_AT)])
    )
    assert sorted(first) == list(range(1, SAVE_AT + 1))
    assert first == {i: straight[i] for i in first}, "the saving run's first iterations are the straight run's"
    lines = _run([*extra, "--load", checkpoint])
    resumed = megatron_lm.printed(lines)
    assert sorted(resumed) == RESUMED, "the new processes start after the checkpoint's iteration"
    return {i: straight[i] for i in RESUMED}, resumed, lines


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_prints_the_straight_runs_iterations(case, tmp_path):
    straight, resumed, _ = straight_and_resumed(CASES[case], str(tmp_path / "checkpoint"))
    for iteration in RESUMED:  # one message per iteration: which value, straight vs resumed
        assert resumed[iteration] == straight[iteration], (
            f"{case}: iteration {iteration} straight {straight[iteration]} resumed {resumed[iteration]}"
        )


def _level_2_members() -> list[str]:
    return sorted(
        f.name for f in registry.all_features() if f.optimization_level is not None and f.optimization_level <= 2
    )


def test_level_2_with_precision_aware_optimizer_trains_and_reuse_fp32_param_steps_aside():
    """Item 3: the level's reuse-fp32-param yields to megatron's --use-precision-aware-optimizer
    given by name: one log line (rank 0 and 1 each log it once), training runs, the final
    "features on" line has every other level-2 feature and not reuse-fp32-param."""
    extra = [*CASES["precision-aware-bf16-moments"], "--optimization-level", "2", "--train-iters", "3"]
    output = megatron_lm.torchrun_output(2, megatron_lm.launcher(), extra)
    said = [line for line in output.splitlines() if STEPPED_ASIDE in line]
    assert 1 <= len(said) <= 2, output[-4000:]  # at most once per process
    lines = megatron_lm.lines_of(output)
    assert len(megatron_lm.losses(lines, 3)) == 3
    on = _features_on(lines[0])
    assert "reuse-fp32-param" not in on
    assert set(_level_2_members()) - {"reuse-fp32-param"} <= on


def test_level_2_without_reuse_fp32_param_by_its_no_flag():
    """Item 3: ``--no-<flag>`` keeps the level and switches one of its features off."""
    output = megatron_lm.torchrun_output(
        2,
        megatron_lm.launcher(),
        [*DISTOPT_BF16, "--optimization-level", "2", "--no-reuse-fp32-param", "--train-iters", "3"],
    )
    assert "stepped aside" not in output
    lines = megatron_lm.lines_of(output)
    assert len(megatron_lm.losses(lines, 3)) == 3
    on = _features_on(lines[0])
    assert "reuse-fp32-param" not in on
    assert set(_level_2_members()) - {"reuse-fp32-param"} <= on


def _features_on(line: str) -> set[str]:
    return {name.strip() for name in line.split("features on:", 1)[1].split(",")}
