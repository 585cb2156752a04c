"""Emulator of ``torch_npu.npu_rms_norm(input, gamma, epsilon=1e-6) -> (y, rstd)``.

Contract (notes/torch-npu-ops.md): gamma's shape is a suffix of input's; input has 2-8 dims;
dtype pairs (input/gamma) fp16/fp32, bf16/fp32, fp16/fp16, bf16/bf16, fp32/fp32; returns a
TUPLE (y, rstd) with rstd fp32 of shape ``x.shape[:x.dim() - gamma.dim()] + [1] * gamma.dim()``;
differentiable in y only, dgamma comes back in fp32. y is returned in input's dtype (the
emulator's assumption where the notes are silent).
"""

from __future__ import annotations

import inspect

import torch

from mindspeed_like.testing.npu_emulator import ContractError, register

_PAIRS = {
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
}


def _signature(input, gamma, epsilon=1e-6):  # noqa: A002 - torch_npu's argument name
    pass


_SIG = inspect.signature(_signature)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, epsilon):
        dims = list(range(x.dim() - gamma.dim(), x.dim()))
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)
        y = (xf * rstd * gamma.float()).to(x.dtype)
        ctx.save_for_backward(x, gamma, rstd)
        ctx.dims = dims
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    def backward(ctx, dy, _drstd):
        x, gamma, rstd = ctx.saved_tensors
        dims = ctx.dims
        x_hat = x.float() * rstd
        g = dy.float()
        lead = list(range(x.dim() - gamma.dim()))
        dgamma = (g * x_hat).sum(lead) if lead else g * x_hat  # fp32, as the op returns it
        gg = g * gamma.float()
        dx = rstd * (gg - x_hat * (gg * x_hat).mean(dims, keepdim=True))
        return dx.to(x.dtype), dgamma, None


@register("npu_rms_norm")
def npu_rms_norm(*args, **kwargs):
    try:
        bound = _SIG.bind(*args, **kwargs)
    except TypeError as error:
        raise ContractError(f"npu_rms_norm(input, gamma, epsilon=1e-6): {error}") from None
    bound.apply_defaults()
    x, gamma, epsilon = bound.arguments["input"], bound.arguments["gamma"], bound.arguments["epsilon"]
    if not isinstance(x, torch.Tensor) or not isinstance(gamma, torch.Tensor):
        raise ContractError("npu_rms_norm: input and gamma must be tensors")
    if isinstance(epsilon, bool) or not isinstance(epsilon, (float, int)):
        raise ContractError(f"npu_rms_norm: epsilon must be a float, got {type(epsilon).__name__}")
    if not 2 <= x.dim() <= 8:
        raise ContractError(f"npu_rms_norm: input must have 2-8 dims, got {x.dim()}")
    if gamma.dim() == 0 or gamma.dim() > x.dim() or tuple(x.shape[x.dim() - gamma.dim() :]) != tuple(gamma.shape):
        raise ContractError(f"npu_rms_norm: gamma shape {tuple(gamma.shape)} is not a suffix of {tuple(x.shape)}")
    if (x.dtype, gamma.dtype) not in _PAIRS:
        raise ContractError(f"npu_rms_norm: dtype pair input={x.dtype} gamma={gamma.dtype} not supported")
    y, rstd = _RmsNorm.apply(x, gamma, float(epsilon))
    expected = tuple(x.shape[: x.dim() - gamma.dim()]) + (1,) * gamma.dim()
    assert rstd.dtype == torch.float32 and tuple(rstd.shape) == expected
    return (y, rstd)
