"""``transformer_engine.pytorch`` as served to clients (``finder.MODULES``): TE's layer modules
(``modules.py``) and its whole-layer modules built from them (``layers.py``), under TE's names;
the refused names raise their refusal (``modules._refused_getattr``)."""

from __future__ import annotations

from typing import Any

from mindspeed_like.te_shim.layers import LayerNormMLP, MultiheadAttention, TransformerLayer
from mindspeed_like.te_shim.modules import (
    DotProductAttention,
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    Linear,
    RMSNorm,
    _refused_getattr,
    autocast,
    fp8_autocast,
    fp8_model_init,
    quantized_model_init,
)


def __getattr__(name: str) -> Any:
    return _refused_getattr(name)


__all__ = [
    "DotProductAttention",
    "GroupedLinear",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MultiheadAttention",
    "RMSNorm",
    "TransformerLayer",
    "autocast",
    "fp8_autocast",
    "fp8_model_init",
    "quantized_model_init",
]
