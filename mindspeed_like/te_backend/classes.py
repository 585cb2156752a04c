"""Our object for each name of megatron's TE extension module the backend binds (imported only
when a patch is installed: these modules subclass megatron's own layers)."""

from __future__ import annotations

from mindspeed_like.te_backend.attention import TEDotProductAttention
from mindspeed_like.te_backend.grouped_linear import (
    TEColumnParallelGroupedLinear,
    TEGroupedLinear,
    TERowParallelGroupedLinear,
)
from mindspeed_like.te_backend.layernorm_linear import TELayerNormColumnParallelLinear
from mindspeed_like.te_backend.linear import TEColumnParallelLinear, TELinear, TERowParallelLinear
from mindspeed_like.te_backend.norm import TENorm
from mindspeed_like.te_backend.refusals import TEActivationOp, TEFusedMLP, TEFusedMLPWithGroupedLinear

__all__ = [
    "TEActivationOp",
    "TEColumnParallelGroupedLinear",
    "TEColumnParallelLinear",
    "TEDotProductAttention",
    "TEFusedMLP",
    "TEFusedMLPWithGroupedLinear",
    "TEGroupedLinear",
    "TELayerNormColumnParallelLinear",
    "TELinear",
    "TENorm",
    "TERowParallelGroupedLinear",
    "TERowParallelLinear",
]
