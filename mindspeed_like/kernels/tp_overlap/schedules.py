"""The three tiled schedules: all-gather then matmul, matmul then reduce-scatter, matmul then
all-reduce. Each cuts the token rows into tiles (``tiles.tile_bounds``) and keeps exactly one
collective per tile in flight under another tile's matmul. They know tensors and process
groups, not layers: ``column.py`` and ``row.py`` compose them into forward and backward.

Row orders: see ``tiles.py``. Inputs are 2-D (tokens flattened) or, for the reduce-scatter,
viewed ``[world, rows_local, k]`` so that tile ``c`` is ``[:, lo:hi]`` of megatron's
rank-major layout.
"""

from __future__ import annotations

import torch

from mindspeed_like.kernels.tp_overlap import ops
from mindspeed_like.kernels.tp_overlap.tiles import tile_bounds


def gather_tiled(
    x2d: torch.Tensor, b: torch.Tensor, tiles: int, group, keep_gathered: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``all_gather(x2d) @ b`` in megatron's rank-major row order: every tile's all-gather is
    issued first, tile ``c``'s matmul runs while tiles ``> c`` are in flight. With
    ``keep_gathered`` also returns ``all_gather(x2d)`` itself in megatron's order."""
    world = group.size()
    rows = x2d.shape[0]
    bounds = tile_bounds(rows, tiles)
    pending = []
    for lo, hi in bounds:  # issue every gather first: they queue on the link in tile order
        buffer = torch.empty((world * (hi - lo), x2d.shape[1]), dtype=x2d.dtype, device=x2d.device)
        pending.append((buffer, ops.all_gather(buffer, x2d[lo:hi], group)))
    # 2-D results written through [world, rows, :] views: the returned tensors are not views
    # (an autograd Function may not return a view of its own intermediate)
    out = torch.empty((world * rows, b.shape[1]), dtype=x2d.dtype, device=x2d.device)
    gathered = torch.empty((world * rows, x2d.shape[1]), dtype=x2d.dtype, device=x2d.device) if keep_gathered else None
    for (lo, hi), (buffer, work) in zip(bounds, pending, strict=True):
        work.wait()
        out.view(world, rows, -1)[:, lo:hi] = ops.matmul(buffer, b).view(world, hi - lo, -1)
        if gathered is not None:
            gathered.view(world, rows, -1)[:, lo:hi] = buffer.view(world, hi - lo, -1)
    return out, gathered


def matmul_reduce_scatter_tiled(a3d: torch.Tensor, b: torch.Tensor, tiles: int, group) -> tuple[torch.Tensor, list]:
    """``reduce_scatter(a @ b)`` for ``a`` viewed ``[world, rows, k]`` (megatron's rank-major
    order): tile ``c``'s slice ``a[:, lo:hi]`` is multiplied, then reduce-scattered into rows
    ``lo:hi`` of this rank's result while the next tile is multiplied. Returns the result and
    the pending work (call :func:`wait_all` before reading it)."""
    world, rows = a3d.shape[0], a3d.shape[1]
    out = torch.empty((rows, b.shape[1]), dtype=a3d.dtype, device=a3d.device)
    pending = []
    for lo, hi in tile_bounds(rows, tiles):
        product = ops.matmul(a3d[:, lo:hi], b).view(world * (hi - lo), -1)
        pending.append((product, ops.reduce_scatter(out[lo:hi], product, group)))  # product kept alive
    return out, pending


def matmul_all_reduce_tiled(a2d: torch.Tensor, b: torch.Tensor, tiles: int, group) -> tuple[torch.Tensor, list]:
    """``all_reduce(a @ b)``: each tile's all-reduce runs under the next tile's matmul.
    Returns the result and the pending work (call :func:`wait_all` before reading it)."""
    out = torch.empty((a2d.shape[0], b.shape[1]), dtype=a2d.dtype, device=a2d.device)
    pending = []
    for lo, hi in tile_bounds(a2d.shape[0], tiles):
        out[lo:hi] = ops.matmul(a2d[lo:hi], b)
        pending.append((None, ops.all_reduce(out[lo:hi], group)))
    return out, pending


def wait_all(pending: list) -> None:
    for _, work in pending:
        work.wait()
