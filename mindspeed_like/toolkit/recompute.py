"""A marker shared by features that recompute: "this call is already recomputed as a whole".

moe-zero-memory reruns the routed experts' whole forward in backward (per experts call, or per
chunk inside moe-alltoall-overlap's pipeline). Inside such a call, a finer recompute
(recompute-activation-function's activation checkpoint, or moe-zero-memory's own wrapper on the
experts module) would only repeat work, so those check :func:`inside_whole_recompute` and step
aside. The marker lives here, not in either feature, so features do not import each other.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


@contextlib.contextmanager
def whole_recompute() -> Iterator[None]:
    """Marks the calls made inside as part of a computation that is recomputed as a whole."""
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def inside_whole_recompute() -> bool:
    """True inside :func:`whole_recompute` (on this thread)."""
    return getattr(_state, "depth", 0) > 0
