"""moe-router (``--use-fused-moe-router``; also megatron's ``--moe-router-fusion``): MoE top-k
routing (score function, expert bias, group-limited top-k, normalisation, scaling) and the
aux-loss scores as single autograd Functions, bitwise equal to megatron's unfused path;
``moe_router_fusion=True`` works without TransformerEngine. Targets and why: ``routing.py``."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.moe_router.routing import (
    AuxLossScores,
    TopKRouting,
    router_aux_loss_scores,
    switch_load_balancing_loss,
    topk_softmax_with_capacity,
)
from mindspeed_like.toolkit.declaration import Context, Feature, Flag, kernel_backend
from mindspeed_like.toolkit.targets import MOE_ROUTER, MOE_UTILS

NAME = "moe-router"
LEGACY = "<0.14"  # topk_softmax_with_capacity (capacity inside); 0.14 split it and added fused=


def patches(ctx: Context) -> list[Patch]:
    fall_back = ctx.fallback(NAME)
    defer_to_te = not ctx["use_fused_moe_router"]  # only moe_router_fusion: a real TE's fused router stays
    return [
        Patch(
            f"{MOE_UTILS}.topk_routing_with_score_function",
            Kind.WRAP,
            TopKRouting(fall_back, defer_to_te),
            versions=">=0.14",
            why="TopKRouter.routing's top-k for every score function (fused= is moe_router_fusion)",
        ),
        Patch(
            f"{MOE_UTILS}.compute_routing_scores_for_aux_loss",
            Kind.WRAP,
            AuxLossScores(fall_back, defer_to_te),
            versions=">=0.14",
            why="the scores every load-balancing loss reads (fused= is moe_router_fusion)",
        ),
        Patch(
            f"{MOE_UTILS}.switch_load_balancing_loss_func",
            Kind.WRAP,
            switch_load_balancing_loss,
            versions=">=0.14",
            why="fused=True raises without TE's fused_moe_aux_loss: megatron's unfused loss instead",
        ),
        Patch(
            f"{MOE_UTILS}.topk_softmax_with_capacity",
            Kind.WRAP,
            topk_softmax_with_capacity,
            versions=LEGACY,
            why="megatron-core 0.13's top-k routing (with the capacity step inside)",
        ),
        Patch(
            f"{MOE_ROUTER}.TopKRouter.compute_routing_scores_for_aux_loss",
            Kind.WRAP,
            router_aux_loss_scores,
            versions=LEGACY,
            why="megatron-core 0.13's aux-loss scores (a TopKRouter method)",
        ),
    ]


def enabled(ctx: Context) -> bool:
    return bool(ctx["use_fused_moe_router"] or ctx["moe_router_fusion"])


FEATURE = Feature(
    name=NAME,
    summary="MoE top-k routing and aux-loss scores as single autograd functions, bitwise megatron's unfused "
    "path (expert bias, group-limited top-k, scaling); moe_router_fusion without TE",
    patches=patches,
    flags=(
        Flag(
            "use_fused_moe_router",
            bool,
            False,
            "compute megatron's MoE top-k routing (softmax/sigmoid scores, expert bias, group-limited top-k, "
            "normalisation, scaling) and the aux-loss scores as single autograd functions saving only what "
            "their backward needs (torch_npu's npu_moe_gating_top_k_softmax chooses softmax experts on NPU); "
            "also lets moe_router_fusion=True work without TransformerEngine",
        ),
        Flag(
            "moe_router_fusion",
            bool,
            False,
            "megatron's --moe-router-fusion (TransformerEngine's fused router): switches this feature on, "
            "whose kernel serves the fused calls when TransformerEngine is not installed",
            megatron_defines=True,
        ),
    ),
    enabled=enabled,
    backend=kernel_backend,
    switched_by="--use-fused-moe-router or --moe-router-fusion",
    switch_on={"use_fused_moe_router": True},
    optimization_level=1,
)

__all__ = ["FEATURE", "NAME"]
