"""moe-zero-memory (``--moe-zero-memory level0``, MindSpeed's spelling): the routed experts keep
no activations for backward beyond their dispatched input rows and probs; backward runs each
chunk's expert forward again (fc1, activation, fc2) right before its backward, inside the
moe-alltoall-overlap pipeline, where the recompute also runs under the gradient all-to-alls.

The mechanism is the ``recompute`` switch of ``moe_alltoall_overlap.pipeline.OverlappedExperts``
(that feature's wrappers read this flag, so this package has no patches of its own); hence it
requires moe-alltoall-overlap. Results are bitwise the same (the same rows through the same ops)."""

from __future__ import annotations

from mindspeed_like.toolkit.declaration import Context, Feature, Flag

NAME = "moe-zero-memory"
LEVELS = ("disable", "level0")


def enabled(ctx: Context) -> bool:
    return ctx["moe_zero_memory"] != "disable"


FEATURE = Feature(
    name=NAME,
    summary="routed experts keep only their dispatched rows for backward and recompute their forward "
    "there, per chunk of the all-to-all pipeline",
    flags=(
        Flag(
            "moe_zero_memory",
            str,
            "disable",
            "level0: the routed experts' activations (fc1 output, activation output, expert output) are not "
            "kept for backward but recomputed there per local expert (needs --moe-alltoall-overlap-comm)",
            choices=LEVELS,
        ),
    ),
    requires=("moe-alltoall-overlap",),
    enabled=enabled,
    backend="any",
    switched_by="--moe-zero-memory level0",
    switch_on={"moe_zero_memory": "level0"},
    optimization_level=2,
)

__all__ = ["FEATURE"]
