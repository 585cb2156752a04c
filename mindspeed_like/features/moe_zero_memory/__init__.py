"""moe-zero-memory (``--moe-zero-memory level0``, MindSpeed's spelling): the routed experts keep
no activations for backward beyond their dispatched input rows and probs; backward runs their
forward again (fc1, activation, fc2) right before their backward.

Two places do the recompute, one per way megatron runs the experts:

- inside moe-alltoall-overlap's pipeline (EP > 1, alltoall dispatcher, that feature on): per chunk,
  under the gradient all-to-alls (the ``recompute`` switch of
  ``moe_alltoall_overlap.pipeline.OverlappedExperts``; that feature's wrappers read this flag);
- everywhere else (EP = 1, the allgather dispatcher, the pipeline not switched on or handing the
  call back): the experts module's whole call as one node (``experts.py``), patched here.

Results are bitwise the same (the same rows through the same ops)."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.moe_zero_memory.experts import ExpertsForward, MoeZeroMemoryUnsupported
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.targets import MOE_EXPERTS

NAME = "moe-zero-memory"
LEVELS = ("disable", "level0")


def patches(ctx: Context) -> list[Patch]:
    forward = ExpertsForward(ctx.fallback(NAME, MoeZeroMemoryUnsupported, "keeping the experts' activations"))
    # Outermost on each class (after the features that change what the experts compute), so the
    # recompute reruns exactly their forward.
    after = ("grouped-gemm", "fused-swiglu", "recompute-activation-function")
    why = "the experts' one call per MoE layer holds every expert activation and nothing else"
    return [
        Patch(f"{MOE_EXPERTS}.SequentialMLP.forward", Kind.WRAP, forward, why=why, after=after),
        Patch(
            f"{MOE_EXPERTS}.GroupedMLP.forward",
            Kind.WRAP,
            forward,
            versions="<0.17",  # deleted in 0.17
            why=why,
            after=after,
        ),
        Patch(f"{MOE_EXPERTS}.TEGroupedMLP.forward", Kind.WRAP, forward, why=why, after=after),
    ]


def enabled(ctx: Context) -> bool:
    return ctx["moe_zero_memory"] != "disable"


FEATURE = Feature(
    name=NAME,
    summary="routed experts keep only their dispatched rows and probs for backward and recompute their "
    "forward there (per chunk inside the all-to-all pipeline, else per experts call)",
    patches=patches,
    flags=(
        Flag(
            "moe_zero_memory",
            str,
            "disable",
            "level0: the routed experts' activations (fc1 output, activation output, expert output) are not "
            "kept for backward but recomputed there (per local expert inside --moe-alltoall-overlap-comm's "
            "pipeline, else per experts call)",
            choices=LEVELS,
        ),
    ),
    enabled=enabled,
    backend="any",
    switched_by="--moe-zero-memory level0",
    switch_on={"moe_zero_memory": "level0"},
    optimization_level=2,
)

__all__ = ["FEATURE", "MoeZeroMemoryUnsupported"]
