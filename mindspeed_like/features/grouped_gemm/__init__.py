"""grouped-gemm (megatron's ``--moe-grouped-gemm``; ``--grouped-gemm auto|on|off``,
``--gemm-gradient-accumulation-fusion``): legacy GroupedMLP's grouped GEMM without the CUDA
``grouped_gemm`` package (torch_npu's ``npu_grouped_matmul`` on NPU, a portable kernel elsewhere).
On by default exactly where megatron would crash. Targets: ``ops.py``."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.grouped_gemm.ops import (
    NAME,
    GroupedGemmOps,
    GroupedGemmUnsupported,
    capability_check_hidden,
    grouped_gemm_available,
    grouped_gemm_package_installed,
    grouped_mlp_forward,
)
from mindspeed_like.toolkit.declaration import Context, Feature, Flag, kernel_backend
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.targets import GROUPED_GEMM_UTIL, MOE_EXPERTS


def patches(ctx: Context) -> list[Patch]:
    ops = GroupedGemmOps(ctx["gemm_gradient_accumulation_fusion"], ctx.fallback(NAME, GroupedGemmUnsupported))
    return [
        Patch(
            f"{GROUPED_GEMM_UTIL}.ops",
            Kind.REPLACE,
            ops,
            update_aliases=False,  # None without the package: other modules' None must stay None
            why="experts.py calls gg.ops.gmm; None without the CUDA grouped_gemm package",
        ),
        Patch(
            f"{GROUPED_GEMM_UTIL}.assert_grouped_gemm_is_available",
            Kind.REPLACE,
            grouped_gemm_available,
            why="GroupedMLP.__init__ asserts the CUDA package; our gmm is provided instead",
        ),
        Patch(
            f"{MOE_EXPERTS}.GroupedMLP.forward",
            Kind.WRAP,
            grouped_mlp_forward,
            why="megatron-core 0.16 asserts bf16 in forward; our gmm computes fp32/fp16 too",
            after=("recompute-activation-function",),
        ),
    ]


def enabled(ctx: Context) -> bool:
    mode = ctx["grouped_gemm"]
    on = mode == "on" or (mode == "auto" and not grouped_gemm_package_installed())
    if ctx["gemm_gradient_accumulation_fusion"] and not on:
        why = "--grouped-gemm off" if mode == "off" else "the grouped_gemm package is installed (--grouped-gemm auto)"
        raise ConfigError(
            f"--gemm-gradient-accumulation-fusion needs mindspeed_like's grouped GEMM, but {why}; "
            "pass --grouped-gemm on, or drop --gemm-gradient-accumulation-fusion"
        )
    return on


FEATURE = Feature(
    name=NAME,
    summary="megatron's moe_grouped_gemm (GroupedMLP) without the CUDA grouped_gemm package "
    "(torch_npu.npu_grouped_matmul on NPU, a portable grouped GEMM elsewhere)",
    patches=patches,
    flags=(
        Flag(
            "grouped_gemm",
            str,
            "auto",
            "provide grouped_gemm.ops.gmm for megatron's GroupedMLP (--moe-grouped-gemm): auto = only when the "
            "CUDA grouped_gemm package is missing; on = also replace an installed package; off = never",
            choices=("auto", "on", "off"),
        ),
        Flag(
            "gemm_gradient_accumulation_fusion",
            bool,
            False,
            "accumulate GroupedMLP's expert weight gradients straight into megatron DDP's main_grad",
        ),
    ),
    enabled=enabled,
    backend=kernel_backend,
    switched_by="--moe-grouped-gemm builds GroupedMLP; on by default when the grouped_gemm package is missing",
    validate_args_hook=capability_check_hidden,
    switch_on={"grouped_gemm": "on"},
)

__all__ = ["FEATURE", "GroupedGemmOps", "GroupedGemmUnsupported", "grouped_gemm_package_installed"]
