"""Fused RMSNorm: ``y = x / sqrt(mean(x^2) + eps) * gamma`` over gamma's (trailing) dims.

Three backends (:func:`mindspeed_like.kernels.backend.backend_for`):

- ``npu``: ``torch_npu.npu_rms_norm(input, gamma, epsilon) -> (y, rstd)``; its own autograd
  (differentiable in y) gives dx and dgamma.
- ``portable``: a hand-written :class:`torch.autograd.Function` that saves only ``x`` and the
  fp32 ``rstd`` (one float per row) for backward. torch's eager ``rms_norm`` is a chain of
  ~8 autograd ops that keeps the upcast input, the normalized output and more alive.
- ``cuda``: torch's fused CUDA RMSNorm (``F.rms_norm`` -> ``aten._fused_rms_norm``, torch >= 2.9),
  the op megatron's local spec already runs there, for same-dtype input and weight; otherwise
  the portable backend.
- ``reference``: the plain eager math of ``torch.nn.RMSNorm`` (the oracle).

The portable backend runs compiled where the host can compile (``kernels/compiled.py``,
``--portable-kernels``), the hand-written Function otherwise.

Semantics follow ``torch.nn.RMSNorm`` of torch >= 2.8 (what megatron's local spec builds), so
checkpoints and losses are interchangeable: everything computed in fp32 (x, rstd and gamma
upcast) and rounded once to x's dtype, which is also the result dtype (as npu_rms_norm's y).
``zero_centered_gamma``: the stored weight is ``gamma - 1`` (megatron's
``layernorm_zero_centered_gamma``); the effective scale is ``weight + 1``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from mindspeed_like.kernels import compiled
from mindspeed_like.kernels.backend import backend_for

_NPU_GAMMA_DTYPES = {
    torch.float16: (torch.float16, torch.float32),
    torch.bfloat16: (torch.bfloat16, torch.float32),
    torch.float32: (torch.float32,),
}


def _eps(eps: float | None, x: torch.Tensor) -> float:
    # torch.nn.RMSNorm's default when eps is None.
    return torch.finfo(x.dtype).eps if eps is None else float(eps)


def _reduce_dims(x: torch.Tensor, weight: torch.Tensor) -> list[int]:
    if weight.dim() == 0 or tuple(x.shape[x.dim() - weight.dim() :]) != tuple(weight.shape):
        raise ValueError(
            f"rms_norm: weight shape {tuple(weight.shape)} is not a suffix of input shape {tuple(x.shape)}"
        )
    return list(range(x.dim() - weight.dim(), x.dim()))


def _scale(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    return weight + 1 if zero_centered_gamma else weight


def reference_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float | None = 1e-5, zero_centered_gamma: bool = False
) -> torch.Tensor:
    """The eager math of ``torch.nn.functional.rms_norm`` (plus zero-centered gamma)."""
    dims = _reduce_dims(x, weight)
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + _eps(eps, x))
    return (xf * rstd * _scale(weight.float(), zero_centered_gamma)).to(x.dtype)


def rms_norm_backward(
    grad_out: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (x's dtype) and fp32 dgamma of ``y = x * rstd * gamma`` on ``[rows, hidden]`` views.

    The operations and their order are those torch's autograd runs through megatron's RMSNorm
    (``torch.nn.functional.rms_norm``: x upcast, ``rsqrt(pow(x, 2).mean(-1) + eps)``, ``x * rstd``,
    ``* gamma``), so that non-finite values land where megatron's do (issue 37 item 3): once
    ``mean(x^2)`` overflows, rstd is 0 and ``sum(dy * gamma * x) * rstd^3`` is ``inf * 0 = NaN``
    on megatron's path, where an algebraically equal order that scales by rstd first gave 0 and
    hid a diverged run for 10 iterations. With this order the results also equal torch's
    autograd bitwise (tests/kernels/test_nonfinite_propagation.py). ``gamma``: fp32 ``[hidden]``;
    ``rstd``: fp32 ``[rows, 1]``."""
    xf = x.float()  # no copy for fp32 input
    g = grad_out.float()
    if g.data_ptr() == grad_out.data_ptr():
        g = g.clone()  # updated in place below; autograd's grad_out is not ours to change
    buf = xf * rstd  # x_hat, as the forward made it
    grad_gamma = buf.mul_(g).sum(0)  # d(x_hat * gamma)/dgamma
    g_hat = g.mul_(gamma)  # the gradient reaching x_hat = x * rstd
    grad_rstd = torch.mul(g_hat, xf, out=buf).sum(1, keepdim=True)
    grad_mean = (grad_rstd * -0.5) * rstd.pow(3)  # rsqrt's derivative; mean(x^2) + eps passes it on
    grad_x = g_hat.mul_(rstd)  # the branch through x_hat's x
    two_x = xf.mul_(2) if xf.data_ptr() != x.data_ptr() else torch.mul(xf, 2, out=buf)
    grad_x.add_(two_x.mul_(grad_mean / x.shape[1]))  # mean's, then pow(x, 2)'s derivative
    return grad_x.to(x.dtype), grad_gamma  # both branches meet at x's one upcast


class _PortableRMSNorm(torch.autograd.Function):
    """Works on a [rows, hidden] view (hidden = gamma.numel()); saves only x and the fp32 rstd;
    backward: :func:`rms_norm_backward`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
        _reduce_dims(x, weight)
        hidden = weight.numel()
        x2 = x.reshape(-1, hidden)
        gamma = _scale(weight, zero_centered_gamma)
        # Eager ops on purpose: aten._fused_rms_norm exists on CPU but measured slower here, and
        # mixed bf16*fp32 elementwise ops are slow on CPU, hence the explicit upcast first.
        xf = x2.float()  # no copy for fp32 input
        rstd = torch.rsqrt(torch.mean(xf * xf, 1, keepdim=True).add_(eps))
        normed = xf.mul_(rstd) if xf.data_ptr() != x2.data_ptr() else xf * rstd  # in place on the upcast copy
        out = normed.mul_(gamma.reshape(hidden).float()).to(x.dtype)
        # The minimum: x (needed for x_hat) and rstd (one fp32 per row). The weight is a
        # parameter that lives anyway; it is kept on ctx rather than saved, so saved-tensor
        # hooks (offloading, byte meters) see only the activations.
        ctx.save_for_backward(x, rstd)
        ctx.weight = weight
        ctx.zero_centered_gamma = zero_centered_gamma
        return out.reshape(x.shape)

    @staticmethod
    @once_differentiable  # no double backward: nothing in megatron's training needs it
    def backward(ctx, grad_out: torch.Tensor):
        x, rstd = ctx.saved_tensors
        weight = ctx.weight
        hidden = weight.numel()
        gamma = _scale(weight.reshape(hidden).float(), ctx.zero_centered_gamma)
        grad_x, grad_gamma = rms_norm_backward(grad_out.reshape(-1, hidden), x.reshape(-1, hidden), gamma, rstd)
        grad_weight = grad_gamma.reshape(weight.shape).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_x = grad_x.reshape(x.shape) if ctx.needs_input_grad[0] else None
        return grad_x, grad_weight, None, None


class _CompiledRMSNorm(torch.autograd.Function):
    """The compiled kernels (kernels/compiled.py) saving what the portable kernel saves: the input as
    given, and the fp32 rstd. The kernels work on ``[rows, hidden]``; reshaping a strided input
    (q sliced from the QKV projection under qk-layernorm, whose heads are not adjacent) copies it.
    Letting the op's own autograd save its inputs kept that copy (a q-sized tensor a layer) and the
    fp32 upcast of the weight until backward, where the input view costs nothing: its storage is
    the projection's output, which attention keeps anyway. Backward reshapes and upcasts again."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
        hidden = weight.numel()
        gamma = _scale(weight, zero_centered_gamma).reshape(-1).float()
        y, rstd = compiled.rms_norm(x.reshape(-1, hidden), gamma, eps)
        ctx.save_for_backward(x, rstd)
        ctx.weight = weight  # a parameter, alive anyway: on ctx, as the portable kernel keeps it
        ctx.zero_centered_gamma = zero_centered_gamma
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, rstd = ctx.saved_tensors
        weight = ctx.weight
        hidden = weight.numel()
        gamma = _scale(weight, ctx.zero_centered_gamma).reshape(-1).float()
        grad_rows = grad_out.reshape(-1, hidden).contiguous()
        grad_x, grad_gamma = compiled.rms_norm_backward(grad_rows, x.reshape(-1, hidden), gamma, rstd)
        grad_weight = grad_gamma.reshape(weight.shape).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_x = grad_x.reshape(x.shape) if ctx.needs_input_grad[0] else None
        return grad_x, grad_weight, None, None


def _npu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    from mindspeed_like.kernels.backends.npu import torch_npu

    gamma = _scale(weight, zero_centered_gamma)
    if gamma.dtype not in _NPU_GAMMA_DTYPES.get(x.dtype, ()):
        gamma = gamma.float()  # e.g. fp32 x with bf16 gamma: not an allowed pair; fp32 gamma always is
    shape = x.shape
    inp = x
    if not 2 <= x.dim() <= 8:  # the op takes 2-8 dims: fold the leading dims into one
        inp = x.reshape(-1, *weight.shape)
    y, _rstd = torch_npu().npu_rms_norm(inp, gamma, epsilon=eps)
    return y.reshape(shape)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float | None = 1e-5,
    zero_centered_gamma: bool = False,
    normalized_shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """RMSNorm of ``x`` over ``weight``'s dims (a suffix of x's shape); any leading shape.

    ``eps=None`` means ``torch.finfo(x.dtype).eps`` (torch.nn.RMSNorm's default).
    """
    if normalized_shape is not None and tuple(normalized_shape) != tuple(weight.shape):
        raise ValueError(f"normalized_shape {tuple(normalized_shape)} != weight shape {tuple(weight.shape)}")
    eps = _eps(eps, x)
    backend = backend_for(x)
    if backend == "reference":
        return reference_rms_norm(x, weight, eps, zero_centered_gamma)
    if backend == "npu":
        return _npu_rms_norm(x, weight, eps, zero_centered_gamma)
    if backend == "cuda" and not zero_centered_gamma and weight.dtype == x.dtype:
        # torch's own fused CUDA kernel (aten._fused_rms_norm, which F.rms_norm picks for dense
        # same-dtype CUDA tensors): megatron's local RMSNorm runs the same op, so this is bitwise
        # megatron's, saves the input and the fp32 rstd as ours does, and costs one launch each way
        # instead of the compiled op's per-call TorchDynamo and AOTAutograd host time.
        return torch.nn.functional.rms_norm(x, tuple(weight.shape), weight, eps)
    if compiled.active(x):
        _reduce_dims(x, weight)
        return _CompiledRMSNorm.apply(x, weight, eps, zero_centered_gamma)
    return _PortableRMSNorm.apply(x, weight, eps, zero_centered_gamma)
