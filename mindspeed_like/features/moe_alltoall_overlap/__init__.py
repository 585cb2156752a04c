"""moe-alltoall-overlap (``--moe-alltoall-overlap-comm``; MindSpeed's ``--moe-permutation-async-comm``
is accepted as the same switch): the alltoall token dispatcher's dispatch and combine all-to-alls
are cut into one chunk per local expert and issued asynchronously, so chunk e + 1 travels while
expert e computes, in forward and backward. Results are bitwise megatron's. Targets and
fallbacks: ``dispatcher.py``; the pipeline: ``pipeline.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.moe_alltoall_overlap.dispatcher import (
    FEATURE_NAME,
    ExpertsCompute,
    MoeAlltoAllOverlapUnsupported,
    RoutedExpertsCompute,
    TokenCombine,
    TokenDispatch,
    shared_fc2_done,
)
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.errors import LevelConflict
from mindspeed_like.toolkit.targets import MOE, MOE_TOKEN_DISPATCHER

DISPATCHER = f"{MOE_TOKEN_DISPATCHER}.MoEAlltoAllTokenDispatcher"
MOE_LAYER = f"{MOE}.moe_layer.MoELayer"


def _recompute(ctx: Context) -> bool:
    """moe-zero-memory's level0 (its own package declares the flag) recomputes the experts inside
    this feature's pipeline: the value is read here so a change swaps the wrappers."""
    try:
        return ctx["moe_zero_memory"] == "level0"
    except KeyError:  # moe-zero-memory not registered
        return False


def patches(ctx: Context) -> list[Patch]:
    fall_back = ctx.fallback(FEATURE_NAME, MoeAlltoAllOverlapUnsupported, "using megatron's blocking all-to-alls")
    recompute = _recompute(ctx)
    return [
        Patch(
            f"{DISPATCHER}.token_dispatch",
            Kind.WRAP,
            TokenDispatch(fall_back),
            why="megatron's blocking dispatch all-to-all: deferred into the experts' step, chunk by chunk",
        ),
        Patch(
            f"{MOE_LAYER}.routed_experts_compute",
            Kind.WRAP,
            RoutedExpertsCompute(fall_back, recompute),
            versions=">=0.15",
            why="the one method holding dispatcher and experts: dispatch a2a -> experts -> combine a2a, pipelined",
        ),
        Patch(
            f"{MOE_LAYER}.experts_compute",
            Kind.WRAP,
            ExpertsCompute(fall_back, recompute),
            versions="<0.15",
            why="0.13-0.14's name of routed_experts_compute (it also runs the shared experts)",
        ),
        Patch(
            f"{DISPATCHER}.token_combine",
            Kind.WRAP,
            TokenCombine(),
            why="megatron's blocking combine all-to-all: after the pipeline the rows are already back",
        ),
        Patch(
            f"{MOE}.shared_experts.SharedExpertMLP.linear_fc2_forward",
            Kind.WRAP,
            shared_fc2_done,
            why="moe_shared_expert_overlap: the pipeline ran the shared experts' fc2 under the all-to-alls",
            after=("cpu-adapter",),  # around the host twin: a pipelined call skips it
        ),
    ]


def _megatrons_default_dispatcher() -> str | None:
    """megatron's default ``moe_token_dispatcher_type`` (TransformerConfig's, which Megatron-LM's
    ``--moe-token-dispatcher-type`` defaults to): allgather in 0.13-0.19."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    field = TransformerConfig.__dataclass_fields__.get("moe_token_dispatcher_type")
    return None if field is None else field.default


@contextlib.contextmanager
def megatron_args_check(args) -> Iterator[None]:
    """validate_args hook: on Megatron-LM's command line a MoE model with another dispatcher is
    a conflict (the feature would never act); EP=1 is said once at the first layer.

    Checked BEFORE megatron's validation runs (both values are the parser's): a conflict raised
    there lets the feature step aside when only ``--optimization-level`` switched it on (the
    MoE examples' default allgather dispatcher at level 1), and is the error when it was asked for
    by name. Raised after validation it could only be an error. A dispatcher that is megatron's
    default is said to be megatron's default, never "given": the user may not have typed it."""
    default = _megatrons_default_dispatcher()
    dispatcher = getattr(args, "moe_token_dispatcher_type", None) or default
    if getattr(args, "num_experts", None) and dispatcher != "alltoall":
        if dispatcher == default:
            uses = f"megatron's default MoE token dispatcher, {dispatcher} (--moe-token-dispatcher-type)"
            reason = (
                f"this MoE run uses megatron's default token dispatcher, {dispatcher}, which has no all-to-alls "
                "to overlap (--moe-token-dispatcher-type alltoall keeps it on)"
            )
        else:
            uses = f"--moe-token-dispatcher-type {dispatcher}"
            reason = ""
        raise LevelConflict(
            FEATURE_NAME,
            f"--moe-token-dispatcher-type {dispatcher}",
            f"--moe-alltoall-overlap-comm overlaps the alltoall dispatcher's all-to-alls, but this run uses "
            f"{uses}: pass --moe-token-dispatcher-type alltoall, or drop "
            "--moe-alltoall-overlap-comm / --moe-permutation-async-comm",
            reason=reason,
        )
    yield


FEATURE = Feature(
    name=FEATURE_NAME,
    summary="the alltoall MoE dispatcher's all-to-alls run asynchronously per local expert, under the "
    "experts' compute (forward and backward)",
    patches=patches,
    flags=(
        Flag(
            "moe_alltoall_overlap_comm",
            bool,
            False,
            "cut the alltoall token dispatcher's dispatch/combine all-to-alls into one chunk per local expert "
            "and run them asynchronously under the experts' compute (EP > 1, >= 2 experts per rank)",
            aliases=("--moe-permutation-async-comm",),
        ),
    ),
    validate_args_hook=megatron_args_check,
    backend="any",
    switched_by="--moe-alltoall-overlap-comm / --moe-permutation-async-comm",
    switch_on={"moe_alltoall_overlap_comm": True},
    optimization_level=1,
)

__all__ = ["FEATURE", "MoeAlltoAllOverlapUnsupported"]
