"""SwiGLU: ``silu(a) * b`` where ``a, b = chunk(x (+ bias), 2, dim=-1)``; optionally weighted.

Megatron computes the gated MLP's activation either inline (``F.silu(a) * b`` under autograd,
which saves ``a``, ``b`` and ``silu(a)``: 1.5x the input) or, with ``bias_activation_fusion``,
through ``BiasSwiGLUFunction`` (a jit-fused elementwise chain). Ours saves only the input
(plus the bias when given, never the biased sum) and recomputes the cheap elementwise part
in backward.

Backends (``mindspeed_like.kernels.backend.backend_for``):

- ``npu``: ``torch_npu.npu_swiglu(input, dim=-1)`` on the (biased) contiguous input; the op
  is differentiable and saves only its input.
- ``portable``: a hand-written autograd Function. The backward uses ATen's fused
  ``silu_backward`` and writes both halves of the gradient straight into one buffer (no
  ``cat``), which is where it beats megatron's eager autograd graph on CPU.
- ``reference``: plain eager math, the oracle of the tests.

The portable backend runs compiled where the host can compile
(``kernels/compiled.py``, ``--portable-kernels``), the hand-written Function otherwise.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from mindspeed_like.kernels import compiled
from mindspeed_like.kernels.backend import backend_for
from mindspeed_like.kernels.backends import cuda_swiglu


def _check(x: torch.Tensor) -> None:
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"swiglu needs an even last dimension, got shape {tuple(x.shape)}")


def _swiglu_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """d(silu(a) * b)/dy for y = [a, b]: [silu'(a) * g * b, g * silu(a)], in one buffer."""
    a, b = y.chunk(2, dim=-1)
    grad_y = torch.empty_like(y, memory_format=torch.contiguous_format)
    grad_a, grad_b = grad_y.chunk(2, dim=-1)
    # Four elementwise passes, no temporaries: each half of the result is built in place.
    torch.mul(grad, b, out=grad_a)
    torch.ops.aten.silu_backward.grad_input(grad_a, a, grad_input=grad_a)
    torch.ops.aten.silu.out(a, out=grad_b)
    grad_b.mul_(grad)
    return grad_y


def _reduce_to_bias(grad_y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return grad_y.reshape(-1, grad_y.shape[-1]).sum(dim=0).to(bias.dtype).reshape(bias.shape)


class _SwiGLU(torch.autograd.Function):
    """Portable backend. Saves ``x`` (and ``bias``): the minimum the backward needs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = x if bias is None else x + bias
        a, b = y.chunk(2, dim=-1)
        ctx.has_bias = bias is not None
        if bias is None:
            ctx.save_for_backward(x)
        else:
            ctx.save_for_backward(x, bias)  # not x + bias: the bias is tiny, the sum is input-sized
        return F.silu(a).mul_(b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.has_bias:
            x, bias = ctx.saved_tensors
            grad_y = _swiglu_backward(grad, x + bias)
            return grad_y, _reduce_to_bias(grad_y, bias)
        (x,) = ctx.saved_tensors
        return _swiglu_backward(grad, x), None


class _WeightedSwiGLU(torch.autograd.Function):
    """Portable ``swiglu(x) * weights`` cast back to x's dtype (megatron's ``weighted_swiglu``:
    the product is formed in the promoted dtype, usually fp32 probabilities). Saves x, weights."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        ctx.save_for_backward(x, weights)
        return (F.silu(a).mul_(b) * weights).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weights = ctx.saved_tensors
        a, b = x.chunk(2, dim=-1)
        # Same dtype order as megatron's weighted_swiglu_back: input grad from g * w (promoted),
        # weight grad from swiglu(x) * g in the weights' dtype.
        grad_x = _swiglu_backward(grad * weights, x).to(x.dtype)
        grad_w = (F.silu(a) * b * grad.to(weights.dtype)).sum(dim=-1, keepdim=True).to(weights.dtype)
        return grad_x, grad_w


def swiglu_reference(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: plain eager math, autograd through it."""
    y = x if bias is None else x + bias
    a, b = torch.chunk(y, 2, dim=-1)
    return F.silu(a) * b


def _swiglu_npu(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from mindspeed_like.kernels.backends.npu import torch_npu

    y = x if bias is None else x + bias
    return torch_npu().npu_swiglu(y.contiguous(), dim=-1)


def swiglu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(a) * b`` with ``a, b = chunk(x + bias, 2, -1)``; any leading shape, fp32/bf16/fp16.

    Saved for backward: ``x`` (and ``bias``) on the portable backend; the biased input on npu.
    """
    _check(x)
    backend = backend_for(x)
    if backend == "npu":
        return _swiglu_npu(x, bias)
    if backend == "reference":
        return swiglu_reference(x, bias)
    if backend == "cuda" and bias is None and _cuda_kernels_serve(x):
        return cuda_swiglu.TritonSwiGLU.apply(x)
    if compiled.active(x):
        return compiled.swiglu(x) if bias is None else compiled.swiglu_bias(x, bias)
    return _SwiGLU.apply(x, bias)


def _cuda_kernels_serve(x: torch.Tensor) -> bool:
    """The Triton kernels of ``backends/cuda_swiglu.py`` take ``x`` (on a GPU the host is the
    bottleneck and they cost one launch each way); not while a user's ``torch.compile`` traces
    the model (the compiled custom op is the traceable form), nor where their once-per-device
    check failed (said once; the compiled or eager portable op runs)."""
    if torch.compiler.is_compiling() or not cuda_swiglu.fits(x):
        return False
    why = cuda_swiglu.failed_check(x.device)
    if why is not None:
        compiled._say_once(f"cuda-swiglu-{x.device}", logging.WARNING, f"mindspeed_like: {why}; portable SwiGLU")
    return why is None


def weighted_swiglu(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``(swiglu(x) * weights).to(x.dtype)``; ``weights`` broadcasts (megatron: ``[tokens, 1]``)."""
    _check(x)
    backend = backend_for(x)
    if backend == "npu":
        return (_swiglu_npu(x, None) * weights).to(x.dtype)
    if backend == "reference":
        return (swiglu_reference(x) * weights).to(x.dtype)
    return _WeightedSwiGLU.apply(x, weights)
