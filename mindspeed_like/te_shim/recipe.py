"""``transformer_engine.common.recipe`` as served to clients: TE's fp8/fp4 recipes, each refused
when constructed (no fp8 without TransformerEngine; train in bf16). The names exist so client
modules that import them at their top level still import."""

from __future__ import annotations

import enum

from mindspeed_like.te_shim.refusals import FP8, Refused


class Format(enum.Enum):
    """TE's fp8 formats (names only: using one needs a recipe, which is refused)."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


def _recipe(name: str) -> type:
    return type(name, (Refused,), {"te_feature": f"{FP8[0]} [{name}]", "alternative": FP8[1], "__module__": __name__})


DelayedScaling = _recipe("DelayedScaling")
Float8CurrentScaling = _recipe("Float8CurrentScaling")
Float8BlockScaling = _recipe("Float8BlockScaling")
MXFP8BlockScaling = _recipe("MXFP8BlockScaling")
NVFP4BlockScaling = _recipe("NVFP4BlockScaling")

__all__ = [
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
]
