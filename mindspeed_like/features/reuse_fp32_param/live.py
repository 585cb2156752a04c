"""Optimizers built with the feature, and what switching it off does to them.

Their fp32 masters live inside the bf16 weights' storage, readable only through the feature's
wrappers: once the patches are gone, megatron's own code would read the shared buffers as plain
fp32 tensors (garbage masters in every checkpoint saved afterwards, Adam on garbage at the next
step). So before the patches go (``configure(reuse_fp32_param=False)``, ``reset()``), every live
Float16 optimizer is converted back to megatron's own layout, exactly (the bf16 weights as they
are, the masters as the exact fp32 values), and a live DistributedOptimizer (whose shards live in
megatron's param buffer) makes the switch a ConfigError that says how to proceed.
"""

from __future__ import annotations

import gc
import weakref

import torch

from mindspeed_like.features.reuse_fp32_param.float16 import STATE_ATTR, ReuseState
from mindspeed_like.toolkit.errors import ConfigError

_live: weakref.WeakSet = weakref.WeakSet()
_seen: weakref.WeakSet = weakref.WeakSet()  # every optimizer built while the feature was on


def seen(optimizer) -> None:
    _seen.add(optimizer)


def was_seen(optimizer) -> bool:
    return optimizer in _seen


def track(optimizer) -> None:
    _live.add(optimizer)


def live_optimizers(collect: bool = True) -> list:
    """The optimizers built with the feature that still hold its layout. ``collect``: first collect
    reference cycles (megatron's optimizers have some), so a dropped one is not converted back at
    switch-off; readers that run every logging interval pass False (a full ``gc.collect()`` each
    time costs a large process real time, and reading a dropped optimizer's masters is harmless)."""
    if _live and collect:
        gc.collect()
    return [o for o in list(_live) if getattr(o, STATE_ATTR, None) is not None]


def restore_megatron_layout(optimizer) -> None:
    """A Float16 optimizer back to megatron's layout: each bf16 weight and fp32 master in its own
    storage, bitwise the values the shared buffer held."""
    state: ReuseState = getattr(optimizer, STATE_ATTR)
    with torch.no_grad():
        weights = [entry.model_param.detach().clone() for entry in state.entries]  # split layout: exact bf16
        state.to_fp32()  # the buffers now hold the exact fp32 masters
        for entry, weight in zip(state.entries, weights):
            entry.main_param.data = entry.main_param.detach().clone()
            entry.model_param.data = weight
    delattr(optimizer, STATE_ATTR)
    _live.discard(optimizer)


def before_switch_off() -> None:
    """Called by the runtime before the feature's patches are removed."""
    live = live_optimizers()
    distributed = [o for o in live if not hasattr(o, "fp32_from_float16_groups")]
    if distributed:
        names = ", ".join(f"{type(o).__name__} at {id(o):#x}" for o in distributed)
        raise ConfigError(
            f"reuse-fp32-param cannot be switched off while {len(distributed)} DistributedOptimizer(s) built "
            f"with it are alive ({names}): their fp32 master shards live inside megatron's bf16 param buffer "
            "and only the feature's wrappers can read them. Save a checkpoint now (it holds plain fp32 "
            "masters), drop the optimizer and model (del optimizer, model; gc.collect()), then switch the "
            "feature off and load the checkpoint; or keep the feature on."
        )
    for optimizer in live:
        restore_megatron_layout(optimizer)
