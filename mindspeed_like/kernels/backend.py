"""Which implementation of a fused op runs: ``npu``, ``cuda``, ``portable`` or ``reference``.

Chosen by the input tensor's device (``npu`` tensors use torch_npu's fused op, ``cuda`` tensors
an op's CUDA implementation where it has one, everything else the portable PyTorch
implementation) unless a test or benchmark forces one with :func:`force_backend`. An op without a
CUDA implementation treats ``cuda`` as ``portable`` (every op branches on the names it has).
``reference`` is the plain eager math, the oracle the tests compare against; it is never chosen
automatically.

Ops with a ``cuda`` backend: the tie bitmask of the shared bf16/fp32 buffers
(:mod:`mindspeed_like.kernels.bf16_ties`, Triton kernels in ``backends/cuda_bf16_residual.py``).
Forcing ``cuda`` on CPU tensors runs those ops' device-independent parts (the sync-free layout
and the eager bitmask ops) on the host: how the tests check the CUDA path without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

BACKENDS = ("npu", "cuda", "portable", "reference")
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
    device = tensor.device.type
    return device if device in ("npu", "cuda") else "portable"
