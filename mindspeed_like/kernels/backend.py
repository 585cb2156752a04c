"""Which implementation of a fused op runs: ``npu``, ``portable`` or ``reference``.

Chosen by the input tensor's device (``npu`` tensors use torch_npu's fused op, everything
else the portable PyTorch implementation) unless a test or benchmark forces one with
:func:`force_backend`. ``reference`` is the plain eager math, the oracle the tests compare
against; it is never chosen automatically.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

BACKENDS = ("npu", "portable", "reference")
_forced = threading.local()


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Run every op inside the block with backend ``name`` (tests, benchmarks)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    previous = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = previous


def backend_for(tensor: torch.Tensor) -> str:
    forced = getattr(_forced, "name", None)
    if forced is not None:
        return forced
    return "npu" if tensor.device.type == "npu" else "portable"
