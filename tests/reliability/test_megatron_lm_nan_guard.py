"""Issue 37 item 3 through Megatron-LM's own pretrain_gpt.py (opt-in): with ``--lr 1e3`` the run
diverges, and megatron's NaN guard (``found NaN/Inf in local grad norm``, ``... in local forward
loss calculation``) stops it at the same iteration with our kernels as on megatron's own path.

Before the fix fused-rmsnorm's analytic backward returned 0 where megatron's autograd returns NaN
(``mean(x^2)`` overflowed): fp32, DP=2, ``--optimization-level 1 --no-use-flash-attn`` stopped at
iteration 17 instead of megatron's 12, the iterations between training a dead model.

Compared here: the levels' kernels whose math is megatron's (RMSNorm, SwiGLU, RoPE: bitwise, NaN
and inf included, tests/kernels/test_nonfinite_propagation.py). Not compared: flash-attention and
fused-linear-cross-entropy are other algorithms for megatron's math (fp32 accumulation, online
softmax): equal within rounding, not bitwise, so a diverging run's first NaN lands on another
iteration (measured: bf16 11 vs megatron's 3, fp32 7 vs 12, earlier as often as later); their NaN
and inf propagation is checked kernel by kernel in that file.

``--rerun-mode disabled``: megatron's guard raises at its first finding instead of re-running the
step and saving a checkpoint (same check, same iteration). Runs of 3-12 iterations, DP=2.
"""

from __future__ import annotations

import functools
import re

import pytest

from mindspeed_like.testing import megatron_lm

pytestmark = pytest.mark.skipif(not megatron_lm.available(), reason=megatron_lm.SKIP_REASON)

DIVERGING = (
    "--ffn-hidden-size 128 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --disable-bias-linear "
    "--untie-embeddings-and-output-weights --clip-grad 1.0 --lr 1e3 --train-iters 30 --rerun-mode disabled"
).split()
PRECISIONS = {"bf16": ["--use-distributed-optimizer", "--bf16"], "fp32": []}
MEGATRONS_MATH = {
    "level-1": ["--optimization-level", "1", "--no-use-flash-attn"],
    "level-2": ["--optimization-level", "2", "--no-use-flash-attn", "--no-use-fused-linear-cross-entropy"],
}
GUARD = re.compile(r"iteration (\d+): Unexpected result (nan|inf) \(message='found (NaN|Inf) in local")


@functools.cache
def first_guarded_iteration(precision: str, features: tuple[str, ...]) -> int:
    output = megatron_lm.torchrun_output(
        2, megatron_lm.launcher(), [*DIVERGING, *PRECISIONS[precision], *features], expect_failure=True
    )
    found = GUARD.findall(output)
    assert found, f"megatron's NaN guard did not stop the run:\n{output[-4000:]}"
    return min(int(iteration) for iteration, *_ in found)


@pytest.mark.parametrize("level", list(MEGATRONS_MATH))
@pytest.mark.parametrize("precision", [pytest.param("bf16"), pytest.param("fp32", marks=pytest.mark.slow)])
def test_nan_guard_stops_at_megatrons_iteration(precision, level):
    megatrons = first_guarded_iteration(precision, ())
    ours = first_guarded_iteration(precision, tuple(MEGATRONS_MATH[level]))
    assert ours == megatrons, (
        f"{precision} {level}: the guard fired at iteration {ours}, megatron's path at {megatrons}"
    )
