"""CPU adapter, random numbers: megatron's "CUDA" RNG tracker runs on torch's CPU generator.

On a CPU host the device generator *is* the CPU generator (dropout draws from it), so
megatron's tracker must save, seed and restore that one.

Targets (megatron/core/tensor_parallel/random.py, 0.13-0.16):
* ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``: the module functions every state swap
  goes through (``CudaRNGStatesTracker.fork``, ``CheckpointFunction`` and recompute). Replaced
  (aliases included) by two-line CPU versions; the cudagraph-safe variants do not apply to CPU.
* ``CudaRNGStatesTracker.add`` and ``model_parallel_cuda_manual_seed``: call
  ``torch.cuda.get_rng_state()`` / ``torch.cuda.manual_seed()`` directly; they run as host twins
  (see ``mindspeed_like.adapters.cpu.host_view``), so seeding "the device" seeds the CPU generator.
* ``CudaRNGStatesTracker.fork``: its check "CPU RNG state changed within GPU RNG context"
  guards against host randomness consumed inside a device-RNG region. On a CPU host there is
  no separate host generator (both are one), so every dropout inside the fork tripped it. The
  twin of ``fork`` sees a torch whose ``get_rng_state`` reports that absent host generator's
  (constant, empty) state; everything else in ``fork`` is megatron's own code.
"""

from __future__ import annotations

import torch

from mindspeed_like.adapters.cpu.host_view import HostTorch, host_wrapper, run_on_host
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.targets import TP_RANDOM as RANDOM

_NO_SEPARATE_HOST_RNG = torch.empty(0, dtype=torch.uint8)


def _get_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """CPU ``_get_cuda_rng_state``: the state of torch's CPU generator (a new tensor each call)."""
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device=-1, graph_safe: bool = False) -> None:
    """CPU ``_set_cuda_rng_state``: set torch's CPU generator."""
    torch.set_rng_state(new_state)


_FORK_TORCH = HostTorch(get_rng_state=lambda: _NO_SEPARATE_HOST_RNG)

PATCHES = [
    Patch(f"{RANDOM}._get_cuda_rng_state", Kind.REPLACE, _get_rng_state, why="device RNG state = CPU generator"),
    Patch(f"{RANDOM}._set_cuda_rng_state", Kind.REPLACE, _set_rng_state, why="device RNG state = CPU generator"),
    Patch(
        f"{RANDOM}.CudaRNGStatesTracker.add",
        Kind.WRAP,
        run_on_host,
        why="torch.cuda.get_rng_state/manual_seed -> CPU generator",
    ),
    Patch(
        f"{RANDOM}.model_parallel_cuda_manual_seed",
        Kind.WRAP,
        run_on_host,
        why="torch.cuda.manual_seed -> CPU generator",
    ),
    Patch(
        f"{RANDOM}.CudaRNGStatesTracker.fork",
        Kind.WRAP,
        host_wrapper(_FORK_TORCH),
        why="no separate host RNG on CPU: the 'CPU RNG state changed' check compares a constant",
    ),
]
