"""recompute-activation-function (``--recompute-activation-function``, ``--recompute-activation-
function-num-layers N``): the MLP activation output is freed after fc2 and recomputed in backward
(dense MLPs, SequentialMLP, GroupedMLP and TEGroupedMLP experts). Targets and fallbacks: ``mlp.py``."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.recompute_activation.checkpoint import needs_hook_safe_checkpoint
from mindspeed_like.features.recompute_activation.layers import layer_init
from mindspeed_like.features.recompute_activation.mlp import (
    GroupedMLPForward,
    MLPForward,
    Recompute,
    RecomputeActivationUnsupported,
    UncoveredGroupedExperts,
)
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.targets import MLP, MOE_EXPERTS, TRANSFORMER_LAYER

NAME = "recompute-activation-function"


def patches(ctx: Context) -> list[Patch]:
    recompute = Recompute(
        num_layers=ctx["recompute_activation_function_num_layers"],
        # megatron's own CheckpointWithoutOutput only on 0.16.x: before, inputs lose their grads under
        # saved-tensor hooks; from 0.17 its recompute shares storage through a C++ extension
        # compiled at the first backward (see checkpoint.py). Elsewhere our copying subclass.
        hook_safe=needs_hook_safe_checkpoint(ctx),
        fall_back=ctx.fallback(NAME, RecomputeActivationUnsupported, "keeping the activation output"),
    )
    return [
        Patch(
            f"{MLP}.MLP.forward",
            Kind.WRAP,
            MLPForward(recompute),
            why="dense MLP, SequentialMLP experts and shared experts: activation inline in forward",
            after=("fused-swiglu",),  # the fused activation runs inside the recompute
        ),
        Patch(
            f"{MOE_EXPERTS}.GroupedMLP.forward",
            Kind.WRAP,
            GroupedMLPForward(recompute),
            versions="<0.17",  # GroupedMLP was deleted in 0.17; its experts are SequentialMLP's MLPs there
            why="grouped experts: switch on megatron's own moe_act recompute for the call",
        ),
        Patch(
            f"{MOE_EXPERTS}.TEGroupedMLP.forward",
            Kind.WRAP,
            GroupedMLPForward(recompute),
            versions="<0.17",
            why="TE-spec grouped experts: the same moe_act switch as GroupedMLP",
            after=("fused-swiglu",),  # outermost: fused-swiglu sees the switch and keeps megatron's GLU
        ),
        Patch(
            f"{MOE_EXPERTS}.TEGroupedMLP.forward",
            Kind.WRAP,
            UncoveredGroupedExperts(recompute),
            versions=">=0.17",
            why="TE-spec grouped experts on 0.17+: said once that they keep their activation output",
            after=("fused-swiglu",),
        ),
        Patch(
            f"{TRANSFORMER_LAYER}.TransformerLayer.__init__",
            Kind.WRAP,
            layer_init,
            why="records each MLP's layer number within its pipeline stage (num-layers selection)",
        ),
    ]


def enabled(ctx: Context) -> bool:
    on = bool(ctx["recompute_activation_function"])
    if ctx["recompute_activation_function_num_layers"] is not None and not on:
        raise ConfigError(
            "--recompute-activation-function-num-layers is set but --recompute-activation-function is not; "
            "pass both (or drop the layer count)"
        )
    return on


def validate(ctx: Context) -> None:
    limit = ctx["recompute_activation_function_num_layers"]
    if limit is not None and limit < 0:
        raise ConfigError(
            f"--recompute-activation-function-num-layers must be >= 0 (layers per pipeline stage), got {limit}"
        )


FEATURE = Feature(
    name=NAME,
    summary="free the MLP activation output after fc2 and recompute it in backward (dense and MoE experts)",
    patches=patches,
    flags=(
        Flag(
            "recompute_activation_function",
            bool,
            False,
            "do not keep the MLP activation output for fc2's backward: free it and recompute it "
            "from fc1's output when fc2's backward needs it (dense MLPs, SequentialMLP and GroupedMLP experts)",
        ),
        Flag(
            "recompute_activation_function_num_layers",
            int,
            None,
            "recompute the activation only in the first N layers of each pipeline stage (default: all layers)",
        ),
    ),
    requires=("fix-checkpoint-without-output-fp8",),
    enabled=enabled,
    validate=validate,
    backend="any",
    switch_on={"recompute_activation_function": True},
    optimization_level=2,
)

__all__ = ["FEATURE", "RecomputeActivationUnsupported"]
