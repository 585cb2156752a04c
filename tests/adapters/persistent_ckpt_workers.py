"""Rank functions of tests/adapters/test_persistent_ckpt_worker.py (spawned gloo processes: importable)."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
import threading
import time

STARTED = time.monotonic()


def said(rank: int, step: str) -> None:
    """Progress on stderr: a run that times out shows how far each rank got."""
    print(f"rank {rank}: {step} ({time.monotonic() - STARTED:.0f} s)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stall_guard(seconds: float, what: str):
    """Interrupt the main thread after ``seconds`` and fail with ``what``: without the cpu adapter's
    ckpt_worker the trainer waits on a dead worker's queue forever (``preload_q.join()``). A real
    SIGINT: ``_thread.interrupt_main()`` only sets a flag, which a thread blocked in that
    semaphore wait never reads."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.daemon = True
    timer.start()
    try:
        yield
    except KeyboardInterrupt as interrupted:
        raise TimeoutError(f"no answer from the persistent checkpoint worker after {seconds:.0f} s: {what}") from (
            interrupted
        )
    finally:
        timer.cancel()


def async_equals_sync_and_a_dead_worker_raises(directory: str, stall_s: float) -> dict:
    """Megatron-LM's test_async_is_equivalent_to_sync (persistent=True) with the import line, on 2
    ranks; the trainer changes its tensors right after scheduling (it trains on), so a worker that
    wrote the trainer's live tensors would save the changed values. Then a worker that cannot
    start (a bad flag in its environment) must raise in the trainer."""
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedTensor, load, save
    from megatron.core.dist_checkpointing.dict_utils import diff
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import mindspeed_like.megatron_adaptor  # noqa: F401  (the import line)
    from mindspeed_like.adapters.cpu.ckpt_worker import WorkerDied
    from mindspeed_like.testing import init_parallel

    init_parallel()
    rank, world = dist.get_rank(), dist.get_world_size()
    said(rank, "imported")
    paths = {name: os.path.join(directory, name) for name in ("async", "sync", "dead")}
    if rank == 0:
        for path in paths.values():
            os.makedirs(path)
    dist.barrier()

    live = {"a": torch.arange(8.0).reshape(2, 4) + 10 * rank, "b": torch.ones(3, 5, 7)}
    original = {name: tensor.clone() for name, tensor in live.items()}

    def sharded(tensors: dict) -> dict:
        return {
            "sd_keyA": ShardedTensor.from_rank_offsets("keyA", tensors["a"], (0, rank, world)),
            "sd_keyB": ShardedTensor.from_rank_offsets("keyB", tensors["b"], replica_id=world - rank - 1),
        }

    # megatron-core 0.19's save defaults to async_strategy="nvrx" (nvidia-resiliency-ext, not on a host);
    # "mcore" is megatron's own AsyncCallsQueue, the one this worker adapts (earlier releases have only it)
    strategy = {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(save).parameters else {}

    def loaded(path: str) -> dict:
        return load(sharded({name: torch.zeros_like(t) for name, t in original.items()}), path)

    out: dict = {}
    with stall_guard(stall_s, "the async save of test_async_is_equivalent_to_sync"):
        queue = AsyncCallsQueue(persistent=True)
        queue.schedule_async_request(save(sharded(live), paths["async"], async_sharded_save=True, **strategy))
        said(rank, "scheduled")
        for tensor in live.values():  # the trainer goes on, in place, while the worker writes
            tensor.add_(1000)
        save(sharded(original), paths["sync"], async_sharded_save=False)
        queue.maybe_finalize_async_calls(blocking=True)
        said(rank, "finalized")
        from_async, from_sync = loaded(paths["async"]), loaded(paths["sync"])
        out["diffs"] = [bool(d) for d in diff(from_async, from_sync)]
        out["async_a"] = from_async["sd_keyA"].tolist()
        out["original_a"] = original["a"].tolist()
        worker = queue.persistent_caller.process
        queue.close()
        out["worker_exitcode"] = worker.exitcode
        said(rank, "closed")

    # a worker that cannot start: the run's entry refuses an unknown flag in the worker
    os.environ["MINDSPEED_LIKE_ARGS"] = "--no-such-flag"
    try:
        with stall_guard(stall_s, "a worker that could not start"):
            dead = AsyncCallsQueue(persistent=True)
            request = save(sharded(original), paths["dead"], async_sharded_save=True, **strategy)
            try:
                dead.schedule_async_request(request)
                out["died"] = None
            except WorkerDied as error:
                out["died"] = str(error)
            dead.close()
            said(rank, "the dead worker seen")
    finally:
        del os.environ["MINDSPEED_LIKE_ARGS"]
    return out
