"""The simulated link of ``simulated_link.py`` for expert-parallel all-to-alls.

Inside ``simulated_alltoall_link(bandwidth)`` every ``torch.distributed.all_to_all_single``
(megatron's ``tensor_parallel.mappings.all_to_all`` and the moe-alltoall-overlap pipeline both
look it up at call time) additionally takes ``bytes / bandwidth`` seconds on the same
per-process, one-at-a-time link model: a call issued at ``t`` starts when the link is free and
completes ``bytes / bandwidth`` later; waiting on it (or a blocking call) sleeps until then,
freeing the core, so expert compute running meanwhile really hides the transfer. Bytes are
what this rank sends to OTHER ranks (its rows for itself never leave it): the input's rows
minus ``input_split_sizes[rank]`` (an even share without splits), times the bytes per row.
Only the all-to-alls are delayed: the other collectives of a step (the dispatcher's token-count
all-gather) cost what gloo costs. ``stats`` reports the total simulated transfer time and how
long callers were blocked on it (the communication not hidden).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from mindspeed_like.testing.simulated_link import LinkStats, _DelayedWork, _Link


def alltoall_bytes(data: torch.Tensor, input_split_sizes, group) -> float:
    """Bytes this rank's ``all_to_all_single`` of ``data`` puts on the link (rows to other ranks)."""
    rows = data.shape[0] if data.dim() else 0
    if rows == 0:
        return 0.0
    row_bytes = data.numel() * data.element_size() / rows
    world = dist.get_world_size(group)
    if input_split_sizes is not None:
        own = list(input_split_sizes)[dist.get_rank(group)]
    else:
        own = rows / world
    return (rows - own) * row_bytes


@contextlib.contextmanager
def simulated_alltoall_link(bandwidth_bytes_per_second: float) -> Iterator[LinkStats]:
    link = _Link(bandwidth_bytes_per_second)
    original = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        done = link.book(alltoall_bytes(input, input_split_sizes, group))
        work = original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        if async_op:
            return _DelayedWork(work, link, done)
        link.block_until(done)
        return work

    all_to_all_single.__wrapped__ = original
    dist.all_to_all_single = all_to_all_single
    try:
        yield link.stats
    finally:
        dist.all_to_all_single = original
