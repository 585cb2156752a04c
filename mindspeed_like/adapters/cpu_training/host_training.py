"""Megatron-LM's training loop (megatron.training) on a CPU host.

megatron.training spells the accelerator in more places than megatron.core: whole modules
(initialize, training, utils, checkpointing) call ``torch.cuda.*``, pass ``device='cuda'`` to
tensor factories and move modules and batches with ``.cuda()``. Twinning each function (as
the core adapter does) would need a patch per function and miss the next one added upstream,
so these modules get their own view of ``torch`` as a module global:

* :data:`TRAINING_HOST_TORCH` is the core adapter's host view (``torch.cuda`` is the host)
  plus: one host "device" (``device_count() == 1``, so Megatron's ``if device_count > 0``
  gates still initialize model parallelism and seed the RNG tracker), ``set_device`` a no-op,
  memory statistics reported as the process's resident memory (torch does not count host
  allocations; RSS is the honest proxy), wall-clock events, and tensor factories that place
  ``device='cuda'`` tensors on the CPU.
* ``.cuda()`` is a method of tensors and modules, out of reach of a module's ``torch`` name.
  :func:`host_region` marks the megatron calls that use it (get_model, the batch loader,
  evaluate); inside a region, ``Tensor.cuda`` / ``Module.cuda`` return their object unmoved.
  Those two wraps are global changes by nature; they act only inside a region and are
  declared as such in the patch report.
"""

from __future__ import annotations

import contextlib
import functools
import resource
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import torch

from mindspeed_like.adapters.cpu.host_view import HostTorch, OneDeviceHostCuda

_CPU = torch.device("cpu")
_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
)  # fmt: skip


def _host_device(device: Any) -> Any:
    """'cuda', 'cuda:N', an int index or a cuda torch.device -> the CPU; anything else unchanged."""
    if isinstance(device, bool) or device is None:
        return device
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _on_host(factory: Any) -> Any:
    @functools.wraps(factory)
    def placed(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _host_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return placed


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _WallClockEvent:
    """A CUDA event on the host: records wall-clock time (work is synchronous on the CPU)."""

    def __init__(self, enable_timing: bool = False, **kwargs: Any) -> None:
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _WallClockEvent) -> float:
        if self._time is None or end._time is None:
            raise RuntimeError("elapsed_time needs both events recorded")
        return (end._time - self._time) * 1000.0


class TrainingHostCuda(OneDeviceHostCuda):
    """``torch.cuda`` as megatron.training sees it on a CPU host (see the module docstring)."""

    Event = _WallClockEvent

    @staticmethod
    def get_device_properties(device: Any = None) -> types.SimpleNamespace:
        # major 0: "before Hopper", the conservative answer for code that gates features on it
        return types.SimpleNamespace(name="cpu", major=0, minor=0, total_memory=0, multi_processor_count=0)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return _rss_bytes()

    memory_reserved = memory_allocated

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return _peak_rss_bytes()

    max_memory_reserved = max_memory_allocated

    @staticmethod
    def memory_stats(device: Any = None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def use_mem_pool(pool: Any = None) -> contextlib.nullcontext:
        return contextlib.nullcontext()


TRAINING_HOST_TORCH = HostTorch(**{name: _on_host(getattr(torch, name)) for name in _FACTORIES})
TRAINING_HOST_TORCH.cuda = TrainingHostCuda()

_region = threading.local()


@contextlib.contextmanager
def host_region() -> Iterator[None]:
    """Inside, ``Tensor.cuda()`` and ``Module.cuda()`` leave their object on the host."""
    _region.depth = getattr(_region, "depth", 0) + 1
    try:
        yield
    finally:
        _region.depth -= 1


def in_host_region() -> bool:
    return getattr(_region, "depth", 0) > 0


def stay_on_host(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for ``Tensor.cuda`` / ``Module.cuda``: identity inside a host region."""
    if in_host_region():
        return instance
    return wrapped(*args, **kwargs)


def run_in_host_region(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper: run a megatron function inside :func:`host_region`."""
    with host_region():
        return wrapped(*args, **kwargs)
