"""MC2: torch_npu's fused communication+matmul kernels for sequence-parallel linears.

- column forward: ``npu_all_gather_base_mm(x, W^T, hcom, tp, gather_output=False)`` (the
  gathered input is not kept: like megatron, backward gathers it again for the weight grad).
- column backward: ``npu_mm_reduce_scatter_base(grad, W, hcom, tp)`` for dgrad, under which
  the input's all-gather (for wgrad) is already in flight.
- row forward: ``npu_mm_reduce_scatter_base(x, W^T, hcom, tp)``.
- row backward: ``npu_all_gather_base_mm(grad, W, hcom, tp, gather_output=True)`` gives dgrad
  and the gathered gradient that the weight gradient needs.

The ops have no autograd, so these Functions are the backward. The contract
(notes/torch-npu-ops.md): tp in {2, 4, 8}; the reduction dimension k in [256, 65535); no
bias (added outside, as megatron does for the row layer); rows divisible by tp for the
reduce-scatter; fp16/bf16; one communicator for all MC2 ops (the TP group's).
``mc2_unsupported`` says why a call cannot take this path (the patch then logs and falls back).
"""

from __future__ import annotations

import math

import torch

from mindspeed_like.kernels.backend import backend_for
from mindspeed_like.kernels.backends.npu import hccl_comm_name, torch_npu
from mindspeed_like.kernels.tp_overlap import ops
from mindspeed_like.kernels.tp_overlap.wgrad import weight_gradient, wgrad_is_computed

WORLD_SIZES = (2, 4, 8)
K_RANGE = (256, 65535)
DTYPES = (torch.float16, torch.bfloat16)


def mc2_unsupported(input: torch.Tensor, weight: torch.Tensor, group, column: bool) -> str | None:
    """None when the MC2 kernels can run this sequence-parallel call, else the reason."""
    if backend_for(input) != "npu":
        return f"needs torch_npu on an Ascend NPU (input is on {input.device.type})"
    world = group.size()
    if world not in WORLD_SIZES:
        return f"tensor-parallel size {world} not in {WORLD_SIZES}"
    if input.dtype not in DTYPES or weight.dtype != input.dtype:
        return f"dtype {input.dtype}/{weight.dtype} (fp16 or bf16 only)"
    n_local_or_out, k_local_or_in = weight.shape
    # column: forward k = hidden (input's last dim), backward k = weight rows (output per rank)
    # row: forward k = weight cols (input per rank), backward k = weight rows (hidden)
    ks = (k_local_or_in, n_local_or_out)
    if not all(K_RANGE[0] <= k < K_RANGE[1] for k in ks):
        return f"matmul reduction dims {ks} outside [{K_RANGE[0]}, {K_RANGE[1]})"
    if not column and math.prod(input.shape[:-1]) % world != 0:
        return f"{math.prod(input.shape[:-1])} token rows not divisible by tensor-parallel size {world}"
    return None


class ColumnParallelMC2(torch.autograd.Function):
    """Megatron's Function arguments (sequence-parallel case)."""

    @staticmethod
    def forward(
        ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, buffer, limit, group
    ):
        ctx.save_for_backward(input, weight)
        ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.use_bias, ctx.fusion, ctx.buffer, ctx.limit, ctx.group = (
            bias is not None,
            gradient_accumulation_fusion,
            buffer,
            limit,
            group,
        )
        ctx.out_shape = (input.shape[0] * group.size(), *input.shape[1:-1], weight.shape[0])
        world = group.size()
        x2d = input.reshape(-1, input.shape[-1]).contiguous()
        out, _ = torch_npu().npu_all_gather_base_mm(
            x2d, weight.t(), hccl_comm_name(group), world, bias=None, gather_index=0, gather_output=False, comm_turn=0
        )
        return out + bias if bias is not None else out  # 2-D: column_parallel_mc2 reshapes

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        group = ctx.group
        if ctx.fusion:
            weight.main_grad = ctx.main_grad
        # megatron buffers the layer-shaped gradient ([s, b, n]): its deferred wgrad reshapes it with the input
        compute = wgrad_is_computed(grad_output.view(ctx.out_shape), ctx.buffer, ctx.limit)
        x2d = input.reshape(-1, input.shape[-1]).contiguous()
        total, gathered = None, None
        if compute:
            total = torch.empty((x2d.shape[0] * group.size(), x2d.shape[1]), dtype=x2d.dtype, device=x2d.device)
            gathered = ops.all_gather(total, x2d, group)
        g2d = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        grad_in = torch_npu().npu_mm_reduce_scatter_base(
            g2d, weight, hccl_comm_name(group), group.size(), reduce_op="sum", bias=None, comm_turn=0
        )
        if gathered is not None:
            gathered.wait()
        grad_weight = weight_gradient(
            weight, g2d, total, accumulation_fusion=ctx.fusion, compute=compute, input_dtype=input.dtype
        )
        grad_bias = g2d.sum(dim=0) if ctx.use_bias else None
        return grad_in.view(input.shape), grad_weight, grad_bias, None, None, None, None, None, None


class RowParallelMC2(torch.autograd.Function):
    """``(input [s, ..., k_local], weight [n, k_local], gradient_accumulation_fusion, group)``
    -> this rank's ``s / tp`` rows of the reduced output."""

    @staticmethod
    def forward(ctx, input, weight, gradient_accumulation_fusion, group):
        ctx.save_for_backward(input, weight)
        ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.fusion, ctx.group = gradient_accumulation_fusion, group
        world = group.size()
        x2d = input.reshape(-1, input.shape[-1]).contiguous()
        out = torch_npu().npu_mm_reduce_scatter_base(
            x2d, weight.t(), hccl_comm_name(group), world, reduce_op="sum", bias=None, comm_turn=0
        )
        return out  # 2-D: row_parallel_mc2 reshapes

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        group = ctx.group
        if ctx.fusion:
            weight.main_grad = ctx.main_grad
        g2d = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        grad_in, gathered = torch_npu().npu_all_gather_base_mm(
            g2d, weight, hccl_comm_name(group), group.size(), bias=None, gather_index=0, gather_output=True, comm_turn=0
        )
        x2d = input.reshape(-1, input.shape[-1])
        grad_weight = weight_gradient(
            weight, gathered, x2d, accumulation_fusion=ctx.fusion, compute=True, input_dtype=input.dtype
        )
        return grad_in.view(input.shape), grad_weight, None, None


def column_parallel_mc2(
    input,
    weight,
    bias,
    gradient_accumulation_fusion,
    allreduce_dgrad,
    sequence_parallel,
    grad_output_buffer,
    wgrad_deferral_limit,
    group,
) -> torch.Tensor:
    """Megatron's column contract (sequence-parallel) through MC2; output ``[s * tp, ..., n]``."""
    output = ColumnParallelMC2.apply(
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        group,
    )
    return output.view(input.shape[0] * group.size(), *input.shape[1:-1], output.shape[-1])


def row_parallel_mc2(input, weight, gradient_accumulation_fusion, group) -> torch.Tensor:
    """The reduce-scattered row-parallel output ``[s / tp, ..., n]`` through MC2 (bias not added)."""
    output = RowParallelMC2.apply(input, weight, gradient_accumulation_fusion, group)
    return output.view(input.shape[0] // group.size(), *input.shape[1:-1], output.shape[-1])
