"""Which code path each part of the model takes in one arm: megatron's own, or a feature's.

The memory model asks these questions instead of reading flags: a feature that is switched on but
cannot act on this model (fused-rmsnorm on a LayerNorm model, flash-attention under context
parallelism, where the CP attention runs instead) takes megatron's path here, as it does in a run.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from mindspeed_like.plan.spec import Run

MEGATRON = "megatron"
FEATURES = "features"


@dataclass(frozen=True)
class Paths:
    """The paths one arm takes; ``feature`` names the feature behind each non-megatron path."""

    fused_rmsnorm: bool = False
    fused_rope: bool = False
    flash_attention: bool = False
    fused_swiglu: bool = False
    recompute_activation: bool = False
    recompute_activation_layers: int | None = None  # first N layers of each chunk; None: all
    fused_linear_cross_entropy: bool = False
    moe_zero_memory: bool = False
    fused_permute: bool = False
    fused_router: bool = False
    grouped_gemm: bool = False
    reuse_fp32_param: bool = False
    precision_aware_portable: bool = False
    host_allocator: bool = False  # glibc keeps every freed block (a CPU host only)

    @property
    def any(self) -> bool:
        return any(getattr(self, name) for name in self.__dataclass_fields__ if name != "recompute_activation_layers")


def megatron_paths() -> Paths:
    """megatron-core's own path (level 0: device adapters and fixes only)."""
    return Paths()


def feature_paths(run: Run, enabled: Collection[str], config: Mapping[str, Any]) -> Paths:
    """The paths of the features arm: each switched-on feature (``enabled``: their names; ``config``:
    the resolved flag values) where it acts on ``run``'s model."""
    model, layout = run.model, run.layout
    on = set(enabled)
    bf16 = run.precision.params == "bf16"
    return Paths(
        fused_rmsnorm="fused-rmsnorm" in on and model.normalization == "RMSNorm",
        fused_rope="fused-rotary-pos-emb" in on and model.position_embedding_type == "rope",
        # under CP megatron has no local CP attention: the context-parallel feature's runs in both arms
        flash_attention="flash-attention" in on and layout.cp == 1,
        fused_swiglu="fused-swiglu" in on and model.gated_linear_unit,
        recompute_activation="recompute-activation-function" in on,
        recompute_activation_layers=config.get("recompute_activation_function_num_layers"),
        fused_linear_cross_entropy="fused-linear-cross-entropy" in on,
        moe_zero_memory="moe-zero-memory" in on and model.is_moe,
        fused_permute="moe-permute" in on and model.is_moe,
        fused_router="moe-router" in on and model.is_moe,
        grouped_gemm="grouped-gemm" in on and model.is_moe,
        # reuse-fp32-param acts on bf16 mixed precision only (megatron's Float16 / Distributed optimizer)
        reuse_fp32_param="reuse-fp32-param" in on and bf16,
        precision_aware_portable="precision-aware-optimizer" in on and run.precision.precision_aware_optimizer,
        # it stands aside where the tensors are not in host memory (docs/features/host-allocator.md)
        host_allocator="host-allocator" in on and run.device == "cpu",
    )
