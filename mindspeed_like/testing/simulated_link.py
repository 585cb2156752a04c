"""A simulated network link for timing tensor-parallel overlap on a CPU host.

On CPU, gloo's collectives between processes on the same cores cost almost nothing and
compete with the matmuls for the cores, so overlap cannot be timed honestly. Inside
``simulated_link(bandwidth)`` every tensor-parallel collective additionally takes
``bytes / bandwidth`` seconds on a per-process, one-at-a-time link: a collective issued at
``t`` starts when the link is free (``max(t, busy_until)``) and completes ``bytes / bandwidth``
later. Waiting on it (or a synchronous call) sleeps until then, which frees the core, so a
matmul running in the meantime really hides the transfer. Bytes are ring-algorithm volumes
per rank: all-gather and reduce-scatter move ``(w - 1) / w`` of the full tensor, all-reduce
twice that.

Patched for the block (and restored): ``torch.distributed.all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_reduce``, ``isend`` (our kernels and megatron's mappings look
them up there at call time; an ``isend`` books the whole tensor on the sender's link, ring
neighbours sending equal sizes at once) and the copies megatron took at import
(``tensor_parallel.layers/mappings.dist_all_gather_func`` / ``dist_reduce_scatter_func``).
``stats`` reports the total simulated transfer time and how long callers were blocked on it.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class LinkStats:
    transfer_seconds: float = 0.0  # sum of bytes / bandwidth over all collectives
    blocked_seconds: float = 0.0  # time callers slept waiting for the link: the exposed part
    collectives: int = 0


class _Link:
    def __init__(self, bandwidth: float) -> None:
        self.bandwidth = bandwidth
        self.busy_until = 0.0
        self.stats = LinkStats()

    def book(self, nbytes: float) -> float:
        duration = nbytes / self.bandwidth
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + duration
        self.stats.transfer_seconds += duration
        self.stats.collectives += 1
        return self.busy_until

    def block_until(self, done: float) -> None:
        start = time.perf_counter()
        if done > start:
            time.sleep(done - start)
            self.stats.blocked_seconds += time.perf_counter() - start  # as slept, overshoot included


class _DelayedWork:
    def __init__(self, work, link: _Link, done: float) -> None:
        self._work, self._link, self._done = work, link, done

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._link.block_until(self._done)
        return result

    def is_completed(self) -> bool:
        return self._work.is_completed() and time.perf_counter() >= self._done


def _world(group) -> int:
    return dist.get_world_size(group)


def _delayed(original, link: _Link, volume, always_async: bool = False):
    def call(*args, **kwargs):
        group = kwargs.get("group")
        world = _world(group)
        nbytes = volume(args, world)
        done = link.book(nbytes)
        work = original(*args, **kwargs)
        if always_async or kwargs.get("async_op", False):
            return _DelayedWork(work, link, done)
        link.block_until(done)
        return work

    call.__wrapped__ = original
    return call


def _gather_bytes(args, world):  # (output, input): output holds world * input
    return args[0].numel() * args[0].element_size() * (world - 1) / world


def _scatter_bytes(args, world):  # (output, input): input holds world * output
    return args[1].numel() * args[1].element_size() * (world - 1) / world


def _reduce_bytes(args, world):  # (tensor,)
    return 2 * args[0].numel() * args[0].element_size() * (world - 1) / world


def _send_bytes(args, world):  # (tensor, dst): point to point, the whole tensor
    return args[0].numel() * args[0].element_size()


@contextlib.contextmanager
def simulated_link(bandwidth_bytes_per_second: float) -> Iterator[LinkStats]:
    link = _Link(bandwidth_bytes_per_second)
    gather = _delayed(dist.all_gather_into_tensor, link, _gather_bytes)
    scatter = _delayed(dist.reduce_scatter_tensor, link, _scatter_bytes)
    reduce = _delayed(dist.all_reduce, link, _reduce_bytes)
    swaps = [
        (dist, "isend", _delayed(dist.isend, link, _send_bytes, always_async=True)),
        (dist, "all_gather_into_tensor", gather),
        (dist, "reduce_scatter_tensor", scatter),
        (dist, "all_reduce", reduce),
    ]
    for module_name in ("megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.mappings"):
        module = importlib.import_module(module_name)
        swaps.append((module, "dist_all_gather_func", _delayed(module.dist_all_gather_func, link, _gather_bytes)))
        swaps.append(
            (module, "dist_reduce_scatter_func", _delayed(module.dist_reduce_scatter_func, link, _scatter_bytes))
        )
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, fn in swaps:
        setattr(owner, name, fn)
    try:
        yield link.stats
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
