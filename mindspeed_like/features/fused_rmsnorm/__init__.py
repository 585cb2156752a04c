"""fused-rmsnorm (``--use-fused-rmsnorm``): megatron's torch RMSNorm runs a fused kernel that
saves only x and rstd for backward (torch_npu's ``npu_rms_norm`` on NPU). See ``norm.py``."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.fused_rmsnorm.norm import FusedRMSNorm, new_fused_rmsnorm
from mindspeed_like.toolkit.declaration import Feature, Flag, kernel_backend
from mindspeed_like.toolkit.targets import TORCH_NORM

PATCHES = [
    Patch(
        f"{TORCH_NORM}.WrappedTorchNorm.__new__",
        Kind.WRAP,
        new_fused_rmsnorm,
        why="the local spec's RMSNorm (all layers and the final norm) runs the fused kernel",
        after=("cpu-adapter",),  # the SP marking of the weight happens first, on megatron's norm
    ),
]

FEATURE = Feature(
    name="fused-rmsnorm",
    summary="RMSNorm through a fused kernel (torch_npu.npu_rms_norm on NPU, a minimal-memory portable one elsewhere)",
    patches=PATCHES,
    flags=(
        Flag(
            "use_fused_rmsnorm",
            bool,
            False,
            "run megatron's RMSNorm through the fused kernel (saves only x and rstd for backward)",
        ),
    ),
    backend=kernel_backend,
    switch_on={"use_fused_rmsnorm": True},
    optimization_level=1,
    built_at_construction="its RMSNorm modules (the norm class is chosen when a layer is built)",
)

__all__ = ["FEATURE", "FusedRMSNorm"]
