"""Process groups and seeds: one call before building a model, one after (demo, compare, tests)."""

from __future__ import annotations

import socket

import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 1234, **kwargs) -> None:
    """Initialize megatron's parallel state (and the default process group if none exists) and seed.

    Without a default process group: under a launcher (torchrun sets ``RANK`` / ``WORLD_SIZE`` /
    ``MASTER_ADDR`` / ``MASTER_PORT``) every rank joins that world (gloo, ``env://``); otherwise a
    one-process gloo group. Extra keyword arguments go to
    ``parallel_state.initialize_model_parallel``. Calling it again re-initializes the
    model-parallel groups (the default process group is kept).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        _init_default_group()
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


class LauncherEnvironmentError(RuntimeError):
    """A launcher's environment is incomplete: the ranks cannot find each other."""


def _init_default_group() -> None:
    import os

    import torch.distributed as dist

    world = os.environ.get("WORLD_SIZE")
    if world is None or int(world) == 1:
        # An in-process store: a one-rank group needs no port (and so cannot collide with one).
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise LauncherEnvironmentError(
            f"WORLD_SIZE={world} says this process is one of {world} ranks, but {', '.join(missing)} "
            "is not set, so it cannot join them. Start it with torchrun (which sets RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT), or unset WORLD_SIZE for a single process."
        )
    dist.init_process_group("gloo", init_method="env://", rank=int(os.environ["RANK"]), world_size=int(world))


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
    clear_moe_loss_log()
    if dist.is_initialized():
        _destroy_subgroups()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()


def clear_moe_loss_log() -> None:
    """Empty megatron's per-layer MoE loss log (a process global): it is sized by the first MoE
    model that logs into it, and a later, deeper model then indexes past its end (IndexError in
    ``save_to_aux_losses_tracker``, seen when the CUDA lane built a 3-layer model after 2-layer ones).
    megatron-core 0.19 keeps it in ``moe_logging``'s MoEMetricsTracker (``moe_utils``'s getter returns
    a copy there, so clearing that emptied nothing: the deepseek preset's MTP layer 3 after a
    2-layer moe model failed so): that tracker is dropped, the next record creates a fresh one."""
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:  # megatron-core < 0.19: the log is moe_utils' dict
        moe_logging = None
    if moe_logging is not None and hasattr(moe_logging, "destroy_moe_metrics_tracker"):
        moe_logging.destroy_moe_metrics_tracker()
        return
    try:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    except ImportError:  # pragma: no cover - megatron without MoE utilities
        return
    get_moe_layer_wise_logging_tracker().clear()


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
