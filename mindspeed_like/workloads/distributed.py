"""Run a function in several gloo processes and collect what each rank returns."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from mindspeed_like.workloads.parallel import free_port

FAILURE_GRACE_S = 3.0
"""After one rank fails, how long the others get to report their own failure or death."""


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"process killed by {name} (exit code {code})"
    return f"process exited with code {code}"


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
    grace_until: float | None = None  # after a failure, a moment for the other ranks to report
    try:
        while len(values) + len(failures) < world_size:
            now = time.monotonic()
            if grace_until is not None and now >= grace_until:
                break
            if now >= deadline:
                missing = sorted(set(range(world_size)) - set(values) - set(failures))
                failures.update({r: f"timed out after {timeout:.0f} s" for r in missing})
                break
            try:
                rank, ok, value = results.get(timeout=min(deadline - now, 0.5))
            except queue.Empty:
                for rank, proc in enumerate(procs):  # died without reporting (segfault, os._exit, OOM kill)
                    if rank not in values and rank not in failures and not proc.is_alive() and results.empty():
                        failures[rank] = f"{_exit_description(proc.exitcode)} without a result"
                if failures and grace_until is None:
                    grace_until = time.monotonic() + FAILURE_GRACE_S
                continue
            (values if ok else failures)[rank] = value
            if not ok and grace_until is None:
                # one failure usually leaves the others blocked in a collective: wait briefly for
                # the ranks that failed too (or died), then stop them
                grace_until = time.monotonic() + FAILURE_GRACE_S
    finally:
        for proc in procs:
            proc.join(timeout=5 if not failures else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(store_dir, ignore_errors=True)
    if failures:
        for rank in set(range(world_size)) - set(values) - set(failures):
            failures[rank] = "still running when another rank failed; killed (likely blocked in a collective)"
        hard = sorted(r for r, msg in failures.items() if "without a result" in msg)
        order = hard + sorted(r for r in failures if r not in hard)
        text = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in order)
        first = f"; rank {hard[0]} died first ({failures[hard[0]]})" if hard else ""
        raise DistributedError(f"{len(failures)} of {world_size} ranks failed{first}:\n{text}")
    return [values[r] for r in range(world_size)]
