"""Row-parallel linear ``y = reduce(x @ W^T)`` with the reduction tiled into the matmul.

Megatron's ``RowParallelLinear`` runs its Function without communication and then reduces
outside it: ``reduce_scatter_to_sequence_parallel_region`` with sequence parallelism,
``reduce_from_tensor_model_parallel_region`` without. Here both are inside one Function:

- forward, SP: "compute first": tile ``c``'s matmul on rows pre-arranged as
  ``x.view(tp, rows_local, k)[:, lo:hi]``, then its reduce-scatter is issued and lands in rows
  ``lo:hi`` of this rank's output (megatron's rank-major split) while tile ``c + 1`` is
  multiplied; all waited at the end. Without SP the same with an all-reduce per tile.
- backward, SP: the reduce-scatter's backward is an all-gather of ``grad_output``; tiles are
  gathered "communicate first" and tile ``c``'s dgrad matmul runs while later tiles are in
  flight. The gathered gradient is kept (in megatron's order) for the weight gradient, which
  megatron computes from the same gathered tensor. Without SP the reduction's backward is the
  identity: plain dgrad/wgrad matmuls, no communication.

The bias is not part of it: megatron adds it after the reduction (or returns it with
``skip_bias_add``), and so does the patched ``RowParallelLinear.forward``.
Saved for backward: the input and the weight, as megatron.
"""

from __future__ import annotations

import torch

from mindspeed_like.kernels.tp_overlap.schedules import (
    gather_tiled,
    matmul_all_reduce_tiled,
    matmul_reduce_scatter_tiled,
    wait_all,
)
from mindspeed_like.kernels.tp_overlap.wgrad import weight_gradient


class RowParallelTiled(torch.autograd.Function):
    """``(input [s, ..., k_local], weight [n, k_local], gradient_accumulation_fusion,
    sequence_parallel, group, tiles)`` -> the reduced (SP: this rank's ``s / tp`` rows) output."""

    @staticmethod
    def forward(
        ctx,
        input: torch.Tensor,
        weight: torch.Tensor,
        gradient_accumulation_fusion: bool,
        sequence_parallel: bool,
        group,
        tiles: int,
    ) -> torch.Tensor:
        main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.save_for_backward(input, weight)
        ctx.main_grad = main_grad
        ctx.fusion = gradient_accumulation_fusion
        ctx.sequence_parallel = sequence_parallel
        ctx.group = group
        ctx.tiles = tiles
        world = group.size()
        x2d = input.reshape(-1, input.shape[-1]).contiguous()
        if sequence_parallel:
            out, pending = matmul_reduce_scatter_tiled(x2d.view(world, -1, x2d.shape[1]), weight.t(), tiles, group)
        else:
            out, pending = matmul_all_reduce_tiled(x2d, weight.t(), tiles, group)
        wait_all(pending)
        return out  # 2-D [tokens, n]; row_parallel_tiled restores the leading dims

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input, weight = ctx.saved_tensors
        if ctx.fusion:
            weight.main_grad = ctx.main_grad
        x2d = input.reshape(-1, input.shape[-1])
        g2d = grad_output.reshape(-1, grad_output.shape[-1])
        if ctx.sequence_parallel:
            grad_in, g2d = gather_tiled(g2d.contiguous(), weight, ctx.tiles, ctx.group, keep_gathered=True)
        else:
            grad_in = g2d.matmul(weight)
        grad_weight = weight_gradient(
            weight, g2d, x2d, accumulation_fusion=ctx.fusion, compute=True, input_dtype=input.dtype
        )
        return grad_in.view(input.shape), grad_weight, None, None, None, None


def row_parallel_tiled(
    input: torch.Tensor,
    weight: torch.Tensor,
    gradient_accumulation_fusion: bool,
    sequence_parallel: bool,
    group,
    tiles: int,
) -> torch.Tensor:
    """The reduced row-parallel output ``[s / tp (SP) or s, ..., n]`` (bias not added)."""
    output = RowParallelTiled.apply(input, weight, gradient_accumulation_fusion, sequence_parallel, group, tiles)
    rows = input.shape[0] // (group.size() if sequence_parallel else 1)
    return output.view(rows, *input.shape[1:-1], output.shape[-1])
