"""Column-parallel linear ``y = x @ W^T (+ b)`` with its tensor-parallel communication tiled.

The same contract as megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` for the
two cases that communicate:

- ``sequence_parallel``: forward all-gathers ``x`` over the TP group ("communicate first":
  every tile's all-gather is issued up front, tile ``c``'s matmul runs while tiles ``> c`` are
  in flight); backward reduce-scatters ``dgrad`` ("compute first": tile ``c``'s dgrad matmul,
  then its reduce-scatter is issued and tile ``c + 1``'s matmul runs under it). The input is
  re-gathered for the weight gradient with one async all-gather issued before the dgrad tiles,
  as megatron does, instead of keeping the gathered input alive between forward and backward.
- ``allreduce_dgrad`` (no SP): forward has no communication; backward all-reduces ``dgrad``
  tile by tile, each tile's all-reduce under the next tile's matmul.

Saved for backward: the local input and the weight, exactly what megatron saves.
"""

from __future__ import annotations

import torch

from mindspeed_like.kernels.tp_overlap import ops
from mindspeed_like.kernels.tp_overlap.schedules import (
    gather_tiled,
    matmul_all_reduce_tiled,
    matmul_reduce_scatter_tiled,
    wait_all,
)
from mindspeed_like.kernels.tp_overlap.wgrad import weight_gradient, wgrad_is_computed


class ColumnParallelTiled(torch.autograd.Function):
    """Arguments as megatron's Function, plus ``tiles`` (the tile count, >= 2)."""

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        grad_output_buffer: list | None,
        wgrad_deferral_limit: int | None,
        group,
        tiles: int,
    ) -> torch.Tensor:
        main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.save_for_backward(input, weight)
        ctx.main_grad = main_grad  # not saved: megatron keeps it on ctx (reused modules, e.g. MTP)
        ctx.use_bias = bias is not None
        ctx.fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.buffer = grad_output_buffer
        ctx.limit = wgrad_deferral_limit
        ctx.group = group
        ctx.tiles = tiles
        ctx.out_shape = (
            input.shape[0] * (group.size() if sequence_parallel else 1),
            *input.shape[1:-1],
            weight.shape[0],
        )
        x2d = input.reshape(-1, input.shape[-1]).contiguous()
        if sequence_parallel:
            output, _ = gather_tiled(x2d, weight.t(), tiles, group)
        else:
            output = torch.matmul(x2d, weight.t())
        if bias is not None:
            output = output + bias
        return output  # 2-D [tokens, n]; column_parallel_tiled restores the leading dims

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input, weight = ctx.saved_tensors
        group = ctx.group
        if ctx.fusion:
            weight.main_grad = ctx.main_grad
        # megatron buffers the layer-shaped gradient ([s, b, n]): its deferred wgrad reshapes it with the input
        compute = wgrad_is_computed(grad_output.view(ctx.out_shape), ctx.buffer, ctx.limit)
        x2d = input.reshape(-1, input.shape[-1])
        gathered = None
        if ctx.sequence_parallel and compute:
            total = torch.empty((x2d.shape[0] * group.size(), x2d.shape[1]), dtype=input.dtype, device=input.device)
            gathered = ops.all_gather(total, x2d.contiguous(), group)
        else:
            total = x2d
        g2d = grad_output.reshape(-1, grad_output.shape[-1])
        if ctx.sequence_parallel:
            g3d = g2d.view(group.size(), -1, g2d.shape[1])
            grad_in, pending = matmul_reduce_scatter_tiled(g3d, weight, ctx.tiles, group)
        else:  # allreduce_dgrad
            grad_in, pending = matmul_all_reduce_tiled(g2d, weight, ctx.tiles, group)
        if gathered is not None:
            gathered.wait()
        grad_weight = weight_gradient(
            weight, g2d, total, accumulation_fusion=ctx.fusion, compute=compute, input_dtype=input.dtype
        )
        grad_bias = g2d.sum(dim=0) if ctx.use_bias else None
        wait_all(pending)  # as megatron: the dgrad communication also runs under the wgrad matmul
        return grad_in.view(input.shape), grad_weight, grad_bias, None, None, None, None, None, None, None


def column_parallel_tiled(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: list | None,
    wgrad_deferral_limit: int | None,
    group,
    tiles: int,
) -> torch.Tensor:
    """Megatron's ``linear_with_grad_accumulation_and_async_allreduce`` contract, tiled.
    Output ``[s * tp (SP) or s, ..., n]``; the reshape is outside the Function so the Function
    never returns a view."""
    output = ColumnParallelTiled.apply(
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        group,
        tiles,
    )
    rows = input.shape[0] * (group.size() if sequence_parallel else 1)
    return output.view(rows, *input.shape[1:-1], output.shape[-1])
