"""Run a function in several gloo processes and collect what each rank returns."""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from mindspeed_like.testing.parallel import free_port


class DistributedError(RuntimeError):
    """A rank failed or timed out; the message carries the child tracebacks."""


def _child(
    rank: int,
    world_size: int,
    port: int,
    store_path: str,
    backend: str,
    fn: Callable,
    args: tuple,
    kwargs: dict,
    results,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        # A file rendezvous, not MASTER_PORT: a port chosen free by the parent can be taken by
        # another suite before rank 0 binds it (EADDRINUSE when test runs overlap).
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        try:
            value = fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # report everything, including SystemExit/KeyboardInterrupt
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 120, backend: str = "gloo", **kwargs: Any
) -> list:
    """Call ``fn(*args, **kwargs)`` in ``world_size`` spawned processes; return per-rank results.

    Each child gets ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT`` (for code that starts its
    own rendezvous), ``RANK``/``WORLD_SIZE``, ``OMP_NUM_THREADS=1`` and an initialized gloo
    default process group, rendezvoused through a private file (destroyed after ``fn``
    returns; ``backend``: another torch.distributed backend, e.g. nccl on GPUs). ``fn`` must be
    importable (module level) and its return value picklable.
    A child's exception is raised here as :class:`DistributedError` with its traceback;
    after ``timeout`` seconds the remaining children are killed.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    store_dir = tempfile.mkdtemp(prefix="mindspeed_like_rendezvous_")
    store_path = os.path.join(store_dir, "store")
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # children read it at interpreter start
    try:
        # Not daemonic: megatron's dist_checkpointing.save starts helper processes (a
        # multiprocessing Manager, the file writers), which a daemonic process may not have.
        # The ``finally`` below kills any child still alive.
        procs = [
            ctx.Process(
                target=_child,
                args=(rank, world_size, port, store_path, backend, fn, args, kwargs, results),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values) - set(failures))
                failures.update({r: f"timed out after {timeout:.0f} s" for r in missing})
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in values and r not in failures]
                for rank in dead:  # died without reporting (segfault, os._exit, OOM kill)
                    time.sleep(0.2)
                    if results.empty():
                        failures[rank] = f"process exited with code {procs[rank].exitcode} without a result"
                continue
            (values if ok else failures)[rank] = value
            if not ok:
                break  # one failure usually leaves the others blocked in a collective
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(store_dir, ignore_errors=True)
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(failures.items()))
        raise DistributedError(f"{len(failures)} of {world_size} ranks failed:\n{text}")
    return [values[r] for r in range(world_size)]
