"""The primitive steps of the tiled kernels: one matmul and three asynchronous collectives.

Every tile of every tiled linear goes through these four functions, looked up on this module
at call time. That is the seam the timeline test and the simulated-link benchmark use
(``mindspeed_like.testing.tp_timeline``): they replace these attributes for a block to record
when each collective is issued and waited and when each matmul starts and ends. The
collectives are the ones megatron itself calls (``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_reduce``), always with ``async_op=True``: the caller keeps
the returned work handle and waits on it where the schedule says.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def all_gather(output: torch.Tensor, input: torch.Tensor, group) -> dist.Work:
    """Rank-major gather of ``input`` (contiguous) into ``output`` ([world * rows, ...])."""
    return dist.all_gather_into_tensor(output, input, group=group, async_op=True)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group) -> dist.Work:
    """Sum over ranks of ``input`` ([world * rows, ...]); rank r keeps block r in ``output``."""
    return dist.reduce_scatter_tensor(output, input, group=group, async_op=True)


def all_reduce(tensor: torch.Tensor, group) -> dist.Work:
    """In-place sum over ranks of ``tensor`` (a contiguous slice of a larger buffer is fine)."""
    return dist.all_reduce(tensor, group=group, async_op=True)
