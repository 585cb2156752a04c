"""fused-swiglu (``--use-fused-swiglu``): megatron's gated-silu MLP activation as one fused op
saving only its input (torch_npu's ``npu_swiglu`` on NPU). Targets and coverage: ``activation.py``."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.fused_swiglu.activation import (
    bias_swiglu_impl,
    grouped_experts_forward,
    mlp_forward,
    weighted_bias_swiglu_impl,
)
from mindspeed_like.toolkit.declaration import Feature, Flag, kernel_backend
from mindspeed_like.toolkit.targets import FUSED_BIAS_SWIGLU, MLP, MOE_EXPERTS

PATCHES = [
    Patch(
        f"{FUSED_BIAS_SWIGLU}.bias_swiglu_impl",
        Kind.WRAP,
        bias_swiglu_impl,
        why="megatron's bias+swiglu fusion entry point (bias_activation_fusion=True)",
    ),
    Patch(
        f"{FUSED_BIAS_SWIGLU}.weighted_bias_swiglu_impl",
        Kind.WRAP,
        weighted_bias_swiglu_impl,
        why="per-token-weighted swiglu of MoE experts (MLP with per_token_scale, TEGroupedMLP)",
    ),
    Patch(
        f"{MLP}.MLP.forward",
        Kind.WRAP,
        mlp_forward,
        why="inline GLU closure (bias_activation_fusion=False) is routed to the fused branch",
    ),
    Patch(
        f"{MOE_EXPERTS}.TEGroupedMLP.forward",
        Kind.WRAP,
        grouped_experts_forward,
        why="TE-spec grouped experts: their inline GLU closure is routed to the weighted fused branch",
    ),
]

FEATURE = Feature(
    name="fused-swiglu",
    summary="gated-silu MLP activation as one fused op saving only its input (torch_npu.npu_swiglu on NPU)",
    patches=PATCHES,
    flags=(
        Flag(
            "use_fused_swiglu",
            bool,
            False,
            "compute megatron's SwiGLU (gated_linear_unit with silu) with a fused kernel "
            "(torch_npu.npu_swiglu on NPU, a portable fused autograd function elsewhere)",
        ),
    ),
    backend=kernel_backend,
    switch_on={"use_fused_swiglu": True},
    optimization_level=1,
)
