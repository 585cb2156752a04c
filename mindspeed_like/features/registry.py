"""The built-in features, in the order they are applied.

Each feature is declared next to its patches in ``mindspeed_like.patches.<module>``;
this list is the one place that says which ones exist.
"""

from __future__ import annotations

from mindspeed_like.features.base import Feature
from mindspeed_like.patches import (
    checkpoint_fp8_default,
    checkpoint_writer_psutil,
    cpu_adapter,
    cpu_training,
    dataset_helpers_build,
    flash_attention,
    fused_rmsnorm,
    fused_rope,
    fused_swiglu,
    grouped_gemm,
    megatron_lm_args,
    npu_adapter,
    recompute_activation,
    reuse_fp32_param,
    tp_overlap,
)

FEATURES: list[Feature] = [
    cpu_adapter.FEATURE,
    cpu_training.FEATURE,
    npu_adapter.FEATURE,
    megatron_lm_args.FEATURE,
    checkpoint_fp8_default.FEATURE,
    dataset_helpers_build.FEATURE,
    checkpoint_writer_psutil.FEATURE,
    fused_swiglu.FEATURE,
    fused_rope.FEATURE,
    fused_rmsnorm.FEATURE,
    flash_attention.FEATURE,
    tp_overlap.FEATURE,
    recompute_activation.FEATURE,
    grouped_gemm.FEATURE,
    reuse_fp32_param.FEATURE,
]


def feature_by_name(name: str) -> Feature:
    for feature in FEATURES:
        if feature.name == name:
            return feature
    raise KeyError(f"no feature named {name!r}; known: {[f.name for f in FEATURES]}")
