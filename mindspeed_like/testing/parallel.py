"""Process groups and seeds for tests: one call before building a model, one after."""

from __future__ import annotations

import socket

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 1234, **kwargs) -> None:
    """Initialize megatron's parallel state (and a 1-process gloo group if none exists) and seed.

    Extra keyword arguments go to ``parallel_state.initialize_model_parallel``. Calling it
    again re-initializes the model-parallel groups (the default process group is kept).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        # An in-process store: a one-rank group needs no port (and so cannot collide with one).
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
        _destroy_subgroups()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        **kwargs,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel(process_group: bool = False) -> None:
    """Destroy megatron's parallel state; with ``process_group=True`` also the default group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    try:  # the global memory buffer / RNG tracker hold state between tests
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        initialize_rng_tracker(force_reset=True)
    except (ImportError, TypeError):  # pragma: no cover - older signatures
        pass
    if dist.is_initialized():
        _destroy_subgroups()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()


def _destroy_subgroups() -> None:
    """Destroy every process group except the default one.

    megatron's ``destroy_model_parallel`` only drops its references: the groups stay registered
    with torch and each gloo group keeps ~3 polling threads alive. Measured: +51 threads per
    ``initialize_model_parallel``; a test suite re-initializing per test reached thousands of
    runnable threads and starved the machine.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    default = distributed_c10d._get_default_group()
    for group in list(distributed_c10d._world.pg_map):
        if group is not default:
            dist.destroy_process_group(group)
