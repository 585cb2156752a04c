"""MoE top-k indices to a multihot routing map with its probs, and back: megatron's
``fused_indices_to_multihot`` (a Triton kernel, ``megatron.core.fusions.fused_indices_converter``)
as torch operations that run on any device.

Contract (megatron's kernel, 0.13-0.19): ``indices [tokens, topk]`` (int), ``probs [tokens, topk]``,
``num_local_experts``. An index ``i`` with ``0 <= i < num_local_experts`` sets
``multihot[t, i] = True`` and ``probs_in_multihot[t, i] = probs[t, k]``; ``-1`` and indices of other
ranks' experts (``>= num_local_experts``) are ignored. Every other entry is False / 0. Backward
hands each routed entry's gradient back to the (token, k) it came from; ignored positions get 0.
An index repeated within a row (not produced by a top-k router) keeps one of its probs, as the
kernel's last store does; which one is not specified there either.

Why torch operations: a scatter into one spare column (where the ignored indices go, cut off
afterwards) and a gather back; the Triton kernel needs a GPU, and the DeepEP/HybridEP dispatchers
(``MoEFlexTokenDispatcher``) call it on every step.
"""

from __future__ import annotations

import torch


def _columns(indices: torch.Tensor, num_local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each (token, k): the expert, or the spare column ``num_local_experts``; its mask)."""
    index = indices.long()
    valid = (index >= 0) & (index < num_local_experts)
    return torch.where(valid, index, num_local_experts), valid


class IndicesToMultihot(torch.autograd.Function):
    """Saves the columns and their mask (the Triton kernel saves a position map of the same role)."""

    @staticmethod
    def forward(ctx, indices: torch.Tensor, probs: torch.Tensor, num_local_experts: int):
        if indices.shape != probs.shape:
            raise ValueError(f"indices {tuple(indices.shape)} and probs {tuple(probs.shape)} must have the same shape")
        tokens = indices.shape[0]
        columns, valid = _columns(indices, num_local_experts)
        wide = (tokens, num_local_experts + 1)
        multihot = torch.zeros(wide, dtype=torch.bool, device=indices.device).scatter_(1, columns, True)
        probs_in_multihot = torch.zeros(wide, dtype=probs.dtype, device=probs.device).scatter_(1, columns, probs)
        ctx.save_for_backward(columns, valid)
        ctx.mark_non_differentiable(multihot)
        return multihot[:, :num_local_experts].contiguous(), probs_in_multihot[:, :num_local_experts].contiguous()

    @staticmethod
    def backward(ctx, _grad_multihot, grad_probs_in_multihot):
        columns, valid = ctx.saved_tensors
        if grad_probs_in_multihot is None:
            return None, None, None
        spare = grad_probs_in_multihot.new_zeros(grad_probs_in_multihot.shape[0], 1)
        gathered = torch.cat([grad_probs_in_multihot, spare], dim=1).gather(1, columns)
        return None, torch.where(valid, gathered, torch.zeros_like(gathered)), None


def indices_to_multihot(
    indices: torch.Tensor, probs: torch.Tensor, num_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(multihot [tokens, num_local_experts] bool, probs_in_multihot)`` (see the module docstring)."""
    return IndicesToMultihot.apply(indices, probs, num_local_experts)
