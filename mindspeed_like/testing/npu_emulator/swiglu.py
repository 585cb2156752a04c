"""Emulator of ``torch_npu.npu_swiglu(input, dim=-1) -> Tensor`` (notes/torch-npu-ops.md).

Contract enforced: one tensor ``input`` (positional or keyword), only the keyword ``dim``
(an int, default -1) besides it; the split dimension even; ``input`` contiguous;
dtype fp32/fp16/bf16. Result: ``silu(a) * b`` for ``a, b = chunk(input, 2, dim)``, in the
input's dtype. Differentiable, saving only its input, like the real op (its backward is
``npu_swiglu_backward(grad, input, dim)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mindspeed_like.testing.npu_emulator import ContractError, register

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        ctx.save_for_backward(x)
        a, b = x.chunk(2, dim=dim)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            a, b = leaf.chunk(2, dim=ctx.dim)
            (grad_x,) = torch.autograd.grad(F.silu(a) * b, leaf, grad)
        return grad_x, None


@register("npu_swiglu")
def npu_swiglu(*args, **kwargs) -> torch.Tensor:
    if len(args) > 2:
        raise ContractError(f"npu_swiglu(input, dim=-1) takes at most 2 positional arguments, got {len(args)}")
    if "input" in kwargs:
        if args:
            raise ContractError("npu_swiglu: input given both positionally and by keyword")
        args = (kwargs.pop("input"),)
    unknown = set(kwargs) - {"dim"}
    if unknown:
        raise ContractError(f"npu_swiglu: unexpected keyword(s) {sorted(unknown)}; the signature is (input, dim=-1)")
    if not args:
        raise ContractError("npu_swiglu: missing input")
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
    if not isinstance(x, torch.Tensor):
        raise ContractError(f"npu_swiglu: input must be a Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ContractError(f"npu_swiglu: dim must be an int, got {dim!r}")
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ContractError(f"npu_swiglu: dim {dim} out of range for shape {tuple(x.shape)}")
    if x.shape[dim] % 2 != 0:
        raise ContractError(f"npu_swiglu: split dim {dim} of shape {tuple(x.shape)} must be even")
    if not x.is_contiguous():
        raise ContractError("npu_swiglu: input must be contiguous")
    if x.dtype not in _DTYPES:
        raise ContractError(f"npu_swiglu: dtype {x.dtype} unsupported (fp32/fp16/bf16)")
    return _Swiglu.apply(x, dim)
