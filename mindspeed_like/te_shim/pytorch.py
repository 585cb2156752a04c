"""``transformer_engine.pytorch`` as served to clients (``finder.MODULES``): TE's layer modules
(``modules.py``) and its whole-layer modules built from them (``layers.py``), under TE's names;
the refused names raise their refusal (``modules._refused_getattr``)."""

from __future__ import annotations

from typing import Any

from mindspeed_like.te_shim import modules
from mindspeed_like.te_shim.layers import LayerNormMLP, MultiheadAttention, TransformerLayer
from mindspeed_like.te_shim.modules import *  # noqa: F403 - its __all__: TE's layer modules and autocasts


def __getattr__(name: str) -> Any:
    return modules._refused_getattr(name)


__all__ = [*modules.__all__, "LayerNormMLP", "MultiheadAttention", "TransformerLayer"]
