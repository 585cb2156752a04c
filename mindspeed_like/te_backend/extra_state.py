"""``_extra_state``: what TransformerEngine's modules keep beside their parameters, TE's way.

TE (2.x) modules carry an ``_extra_state`` entry in every state dict: the fp8 scaling metadata
(recipe, scales, amax histories) pickled into a uint8 tensor, or an EMPTY uint8 tensor when the
module never ran in fp8. megatron's TE wrappers put it into the distributed checkpoint as a
sharded object. Our TE-compatible modules write it exactly so (empty: nothing here runs fp8), so
checkpoints have the keys a TE-spec model has, and take any TE checkpoint's value on load:
empty or None (megatron's local layers write None) is nothing to restore; fp8 scaling state from a
GPU fp8 run has no meaning without fp8 and is dropped, said once.
"""

from __future__ import annotations

import io
import logging
from typing import Any

import torch

logger = logging.getLogger("mindspeed_like")

_said: set[str] = set()


def holds_nothing(state: Any) -> bool:
    """An ``_extra_state`` with nothing to restore: None (megatron's local layers) or an empty tensor
    (a TE module that never ran in fp8, and every module of this backend)."""
    return state is None or (isinstance(state, torch.Tensor) and state.numel() == 0)


class TEExtraState:
    """Mixin (before the torch module in the bases): TE's ``get_extra_state`` / ``set_extra_state``."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        if holds_nothing(state):
            return
        if isinstance(state, (torch.Tensor, io.BytesIO)):
            kind = type(self).__name__
            if kind not in _said:
                _said.add(kind)
                logger.warning(
                    "mindspeed_like te-backend: a checkpoint's fp8 scaling state for %s modules was not loaded "
                    "(TransformerEngine fp8 metadata; this backend runs no fp8, the weights load as usual)",
                    kind,
                )
            return
        raise TypeError(
            f"{type(self).__name__}._extra_state: expected a uint8 tensor (TransformerEngine's format), None or "
            f"io.BytesIO (TE 1.x), got {type(state).__name__}"
        )
