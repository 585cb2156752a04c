"""Emulator of ``torch_npu.npu_moe_gating_top_k_softmax(x, finished=None, k=1) -> (y, expert_idx,
row_idx)`` (Ascend's torch_npu API reference, "npu_moe_gating_top_k_softmax", and CANN's
``aclnnMoeGatingTopKSoftmax``).

Contract enforced: ``x`` a 2D or 3D tensor, fp16/bf16/fp32; ``finished`` None or a bool tensor
of shape ``x.shape[:-1]``; ``k`` an int with ``0 < k <= x.shape[-1]`` and ``k <= 1024``; no other
arguments. The op is documented for inference only (it has no backward): a call whose ``x``
requires grad while autograd records is refused. Result: ``y`` the top-k of ``softmax(x, -1)``
in x's dtype; ``expert_idx`` their expert numbers (int32), ``num_experts`` on rows ``finished``
marks; ``row_idx`` (int32) = ``arange(rows * k).reshape(k, rows).T`` (the documented formula,
over the flattened leading dimensions).
"""

from __future__ import annotations

import torch

from mindspeed_like.testing.npu_emulator import ContractError, register

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@register("npu_moe_gating_top_k_softmax")
def npu_moe_gating_top_k_softmax(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    names = ("x", "finished", "k")
    if len(args) > len(names):
        raise ContractError(f"npu_moe_gating_top_k_softmax(x, finished=None, k=1): {len(args)} positional arguments")
    unknown = set(kwargs) - set(names)
    if unknown:
        raise ContractError(f"npu_moe_gating_top_k_softmax: unexpected keyword(s) {sorted(unknown)}")
    bound = dict(zip(names, args))
    for name, value in kwargs.items():
        if name in bound:
            raise ContractError(f"npu_moe_gating_top_k_softmax: {name} given twice")
        bound[name] = value
    if "x" not in bound:
        raise ContractError("npu_moe_gating_top_k_softmax: missing x")
    x, finished, k = bound["x"], bound.get("finished"), bound.get("k", 1)
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        raise ContractError(f"npu_moe_gating_top_k_softmax: x must be a 2D/3D tensor, got {getattr(x, 'shape', x)}")
    if x.dtype not in _DTYPES:
        raise ContractError(f"npu_moe_gating_top_k_softmax: dtype {x.dtype} unsupported (fp16/bf16/fp32)")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 < k <= x.shape[-1] or k > 1024:
        raise ContractError(f"npu_moe_gating_top_k_softmax: k={k!r} must be an int in (0, {min(x.shape[-1], 1024)}]")
    if finished is not None:
        if not isinstance(finished, torch.Tensor) or finished.dtype != torch.bool:
            raise ContractError("npu_moe_gating_top_k_softmax: finished must be a bool tensor")
        if tuple(finished.shape) != tuple(x.shape[:-1]):
            raise ContractError(
                f"npu_moe_gating_top_k_softmax: finished shape {tuple(finished.shape)} != x.shape[:-1] "
                f"{tuple(x.shape[:-1])}"
            )
    if x.requires_grad and torch.is_grad_enabled():
        raise ContractError("npu_moe_gating_top_k_softmax is inference-only (no backward); call it on a detached x")
    with torch.no_grad():
        y, idx = torch.topk(torch.softmax(x.float(), dim=-1), k=k, dim=-1)
        expert_idx = idx.to(torch.int32)
        if finished is not None:
            expert_idx = expert_idx.masked_fill(finished.unsqueeze(-1), x.shape[-1])
        rows = expert_idx.numel() // k
        row_idx = torch.arange(rows * k, dtype=torch.int32).reshape(k, rows).t().reshape(expert_idx.shape)
    return y.to(x.dtype), expert_idx, row_idx
