"""Fix: Megatron-LM reports the second logged iteration of every run (fresh or resumed) as the mean
of two iterations' losses when the first iteration falls on the log interval (megatron-core 0.16+).

``megatron.training.training.training_log`` accumulates each iteration's losses in
``total_loss_dict`` and, at every ``--log-interval``-th iteration, prints their mean over the
iterations since the last print and resets the sums. From core_v0.16.0 (commit c40b6ea, "better
time accounting of startup operations") ``train()`` also passes ``is_first_iteration=True`` for the
first iteration of a run, which is printed whatever the interval ("to document initialization
overhead") with ``should_reset = not is_first_iteration``, so that "normal interval stats remain
accurate": the first iteration is counted again in the next regular print. That is right when the
first iteration is an extra print (iteration 1 at ``--log-interval 100``: the print at 100 averages
1-100). When the first iteration IS a regular print (``iteration % log_interval == 0``: every run
at ``--log-interval 1``, or a resume from iteration ``k`` with ``k + 1`` on the interval), it is
printed on its own and then counted again: the next print shows the mean of both iterations.
Measured (Megatron-LM core_v0.16.1 pretrain_gpt.py, TINY model, DP=2, bf16, DistributedOptimizer,
``--log-interval 1``): 6 iterations straight print iteration 5's ``lm loss`` as 5.358057; resumed
from iteration 3, iteration 4 prints 5.398541 (equal) and iteration 5 prints 5.378300 =
(5.398541 + 5.358057) / 2, while the grad norms and iteration 6 are bit for bit equal; a fresh run
prints iteration 2 as the mean of iterations 1 and 2. The interval timer is likewise not reset, so
the second print's time per iteration averages in the first iteration's start-up time.

Here a first iteration that falls on the interval is logged as the regular print it is
(``is_first_iteration=False``: the sums and the interval timer reset after it); a first iteration
off the interval keeps megatron's extra, non-resetting print. Only what is printed changes;
training does not (``training_log`` reads the losses, it never feeds them back).
Why ``training_log`` is the target: the flag's only reader, called once per iteration by name from
``train()`` in the same module.
"""

from __future__ import annotations

import sys

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import TRAINING_LOOP

VERSIONS = ">=0.16"  # is_first_iteration arrived in core_v0.16.0 (commit c40b6ea)


def regular_print(iteration: int, log_interval: int) -> bool:
    """Whether megatron prints this iteration on its regular schedule."""
    return bool(log_interval) and iteration % log_interval == 0


def _first_iteration_on_the_interval_resets(wrapped, instance, args, kwargs):
    call = Call(wrapped, args, kwargs)
    if not call.get("is_first_iteration", False):
        return wrapped(*args, **kwargs)
    log_interval = getattr(sys.modules[TRAINING_LOOP].get_args(), "log_interval", 0)
    if not regular_print(call["iteration"], log_interval):
        return wrapped(*args, **kwargs)
    return call(is_first_iteration=False)


PATCHES = [
    Patch(
        f"{TRAINING_LOOP}.training_log",
        Kind.WRAP,
        _first_iteration_on_the_interval_resets,
        optional=True,  # megatron.training: a Megatron-LM checkout (in the wheel from 0.17)
        module=TRAINING_LOOP,
        versions=VERSIONS,
        why="a first iteration on the log interval resets the loss sums (its loss was averaged into the next print)",
    )
]

FEATURE = Feature(
    name="fix-training-log-first-iteration",
    summary="Megatron-LM's loss print after a run's first iteration is that iteration's own when the first "
    "iteration falls on --log-interval (it was the mean of both)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
