"""grouped-gemm (megatron's ``--moe-grouped-gemm``; ``--grouped-gemm auto|on|off``,
``--gemm-gradient-accumulation-fusion``): MoE experts as grouped GEMMs without the CUDA
``grouped_gemm`` package (torch_npu's ``npu_grouped_matmul`` on NPU, a portable kernel elsewhere).
megatron-core 0.13-0.16: legacy GroupedMLP's ``gmm`` (on by default exactly where megatron would
crash; targets: ``ops.py``). 0.17+ (GroupedMLP deleted; the local spec builds SequentialMLP for
``moe_grouped_gemm=True``): SequentialMLP's experts as one grouped GEMM per linear
(``sequential.py``)."""

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
from mindspeed_like.features.grouped_gemm.sequential import SequentialExpertsForward
from mindspeed_like.features.grouped_gemm.te_experts import TEGroupedExpertsServed
from mindspeed_like.toolkit.declaration import Context, Feature, Flag, kernel_backend
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.targets import GROUPED_GEMM_UTIL, MOE_EXPERTS

LEGACY = "<0.17"  # GroupedMLP and grouped_gemm_util: deleted in megatron-core 0.17


def patches(ctx: Context) -> list[Patch]:
    fall_back = ctx.fallback(NAME, GroupedGemmUnsupported)
    ops = GroupedGemmOps(fusion_mode(ctx), fall_back)
    return [
        Patch(
            f"{GROUPED_GEMM_UTIL}.ops",
            Kind.REPLACE,
            ops,
            update_aliases=False,  # None without the package: other modules' None must stay None
            versions=LEGACY,
            why="experts.py calls gg.ops.gmm; None without the CUDA grouped_gemm package",
        ),
        Patch(
            f"{GROUPED_GEMM_UTIL}.assert_grouped_gemm_is_available",
            Kind.REPLACE,
            grouped_gemm_available,
            versions=LEGACY,
            why="GroupedMLP.__init__ asserts the CUDA package; our gmm is provided instead",
        ),
        Patch(
            f"{MOE_EXPERTS}.GroupedMLP.forward",
            Kind.WRAP,
            grouped_mlp_forward,
            versions=LEGACY,
            why="megatron-core 0.16 asserts bf16 in forward; our gmm computes fp32/fp16 too",
            after=("recompute-activation-function",),
        ),
        Patch(
            f"{MOE_EXPERTS}.SequentialMLP.forward",
            Kind.WRAP,
            SequentialExpertsForward(
                GroupedGemmOps("off", fall_back), ctx["gemm_gradient_accumulation_fusion"], fall_back
            ),
            versions=">=0.17",
            why="moe_grouped_gemm=True builds SequentialMLP on 0.17+: its experts' linears as one grouped GEMM each",
        ),
        Patch(
            f"{MOE_EXPERTS}.TEGroupedMLP.forward",
            Kind.WRAP,
            TEGroupedExpertsServed(fall_back),
            why="TE-spec grouped experts: their TE grouped linears are already one grouped GEMM each (te-backend, "
            "this feature's kernel); the report says so instead of 'never reached'",
            after=("fused-swiglu", "recompute-activation-function"),  # a pass-through: outermost
        ),
    ]


def fusion_mode(ctx: Context) -> str:
    """Gradient-accumulation fusion of GroupedMLP's expert weights: auto (where DDP's main_grad
    exists), on (required) or off."""
    if ctx["gemm_gradient_accumulation_fusion"] and ctx["no_gemm_gradient_accumulation_fusion"]:
        raise ConfigError(
            "--gemm-gradient-accumulation-fusion and --no-gemm-gradient-accumulation-fusion contradict each "
            "other; pass one of them"
        )
    if ctx["no_gemm_gradient_accumulation_fusion"]:
        return "off"
    return "on" if ctx["gemm_gradient_accumulation_fusion"] else "auto"


def enabled(ctx: Context) -> bool:
    fusion_mode(ctx)  # a contradiction is a configuration error, said at configure time
    mode = ctx["grouped_gemm"]
    on = mode == "on" or (mode == "auto" and not grouped_gemm_package_installed())
    if ctx["gemm_gradient_accumulation_fusion"] and not on:
        why = "--grouped-gemm off" if mode == "off" else "the grouped_gemm package is installed (--grouped-gemm auto)"
        raise ConfigError(
            f"--gemm-gradient-accumulation-fusion needs mindspeed_like's grouped GEMM, but {why}; "
            "pass --grouped-gemm on, or drop --gemm-gradient-accumulation-fusion"
        )
    return on


def _backend(ctx: Context) -> str:
    """The kernel, and on a CPU which bf16 GEMM path this host takes (one probe a process,
    kernels/host_gemm.py): oneDNN's bf16 GEMMs at bucketed row counts where the host has bf16
    units, fp32 GEMMs on the unpadded rows where it does not."""
    backend = kernel_backend(ctx)
    if ctx.device != "cpu":
        return backend
    from mindspeed_like.kernels.host_gemm import probe

    found = probe()
    path = "fp32 GEMMs, rows unpadded" if found.fp32_faster else "oneDNN bf16 GEMMs, row counts bucketed"
    return f"{backend} (bf16 experts: {path}; {found.describe()})"


FEATURE = Feature(
    name=NAME,
    summary="megatron's moe_grouped_gemm without the CUDA grouped_gemm package: GroupedMLP's gmm (megatron-core "
    "<0.17), SequentialMLP's experts as grouped GEMMs (0.17+); npu_grouped_matmul on NPU, portable elsewhere",
    patches=patches,
    flags=(
        Flag(
            "grouped_gemm",
            str,
            "auto",
            "grouped GEMM for megatron's --moe-grouped-gemm experts (GroupedMLP's gmm before megatron-core 0.17, "
            "SequentialMLP's expert linears from 0.17): auto = only when the CUDA grouped_gemm package is missing; "
            "on = also replace an installed package; off = never",
            choices=("auto", "on", "off"),
        ),
        Flag(
            "gemm_gradient_accumulation_fusion",
            bool,
            False,
            "require GroupedMLP's expert weight gradients to go straight into megatron DDP's main_grad (done by "
            "default wherever main_grad exists; this also reports a weight without it) (megatron-core <0.17; "
            "SequentialMLP's per-expert weights: logged, computed normally)",
        ),
        Flag(
            "no_gemm_gradient_accumulation_fusion",
            bool,
            False,
            "keep megatron's unfused expert weight gradient (a fresh [E, K, N] tensor each step, added to "
            "main_grad by DDP's hook) instead of accumulating into main_grad",
        ),
    ),
    enabled=enabled,
    backend=_backend,
    switched_by="--moe-grouped-gemm; on by default when the grouped_gemm package is missing",
    validate_args_hook=capability_check_hidden,
    switch_on={"grouped_gemm": "on"},
    switch_off={"grouped_gemm": "off"},
    optimization_level=1,
)

__all__ = ["FEATURE", "GroupedGemmOps", "GroupedGemmUnsupported", "grouped_gemm_package_installed"]
