"""Which megatron models exist now: features that act when a model is BUILT (e.g. fused-rmsnorm
picks the norm module at construction) cannot change a model that already exists, so switching
them with configure() afterwards is said, not silent (``runtime.apply``).

A model is counted by its ``TransformerBlock`` (every GPT, MoE and hybrid model of megatron-core
has one), recorded by the always-on ``model-construction-tracker`` integration.
"""

from __future__ import annotations

import gc
import threading
import weakref

_lock = threading.Lock()
_blocks: weakref.WeakSet = weakref.WeakSet()


def record(block: object) -> None:
    with _lock:
        _blocks.add(block)


def live_count() -> int:
    """Transformer blocks still alive (after a collection: dropped models in cycles do not count)."""
    gc.collect()
    with _lock:
        return len(_blocks)


def forget() -> None:
    """``reset()``: the state of a fresh import, which knows of no model built before it."""
    with _lock:
        _blocks.clear()
