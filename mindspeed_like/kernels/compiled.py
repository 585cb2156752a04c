"""The compiled portable backend: the portable SwiGLU, RMSNorm and RoPE forward/backward as
``torch.compile``'d kernels behind ``torch.library`` custom ops.

Why: the portable kernels are eager autograd Functions, several elementwise passes each, while
megatron's own path compiles its fused activations (``jit_fuser`` is ``torch.compile``) when
TorchDynamo is on; one generated kernel per op reads and writes each tensor once.

How:
- each kernel body is plain torch math compiled with ``torch.compile`` on first use, the row
  dimensions marked dynamic (see :func:`_run`): one compiled graph per dtype/rank family, no
  recompilation when the batch or sequence length changes (tests/kernels/test_compiled_kernels.py
  checks this over GPT steps);
- on a CPU the compile names the vector width Inductor picks in this process (``cpp.simdlen``,
  see :func:`cpu_compile_options`), so the width is part of Inductor's FX graph cache key: torch
  2.13's key leaves ``ATEN_CPU_CAPABILITY`` and the host's ISA out, and a cached graph generated
  for AVX-512 (32 bf16 lanes) rebuilt for AVX2 (16) computed a wrong RMSNorm (NaN losses) when the
  capability changed under one cache directory (the CPU-ISA lane; a cache shared by hosts);
- the custom ops (``mindspeed_like::swiglu``, ``swiglu_backward``, ``rms_norm``,
  ``rms_norm_backward``, ``rope``, ``rope_backward``) carry fake (meta) implementations and
  autograd registrations, so a user's own ``torch.compile`` of the model traces through them as
  single opaque nodes (checked with ``torch.library.opcheck``);
- where compiling is unavailable (``TORCHDYNAMO_DISABLE=1``, no compiler for the device, a
  compile error, dynamo's recompile limit) the same math runs eagerly, said once in the log.

Which: ``--portable-kernels`` ``auto`` (default) / ``compiled`` / ``eager``. ``auto`` compiles
when TorchDynamo is enabled and Inductor can generate code for the device (a C++ compiler on
CPU, triton on CUDA). That is the rule for SwiGLU and RMSNorm, whose compiled kernels beat the
eager chains in every measured row (benchmarks/fused_ops_{swiglu,rmsnorm}.py); RoPE goes
compiled only for partial rotation, also measured (kernels/rope.py says why). Saved tensors are
the eager portable kernels' (SwiGLU: its input; RMSNorm: input and fp32 rstd; RoPE: cos/sin).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable

import torch
import torch.nn.functional as F

MODES = ("auto", "compiled", "eager")
_log = logging.getLogger("mindspeed_like")
# configured: --portable-kernels as the runtime applied it; override: set_mode (tests, benchmarks)
_state: dict = {"configured": "auto", "override": None, "said": set()}
_compiled: dict[tuple[str, str], Callable] = {}


def _check(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"portable kernels mode must be one of {MODES}, got {mode!r}")
    return mode


def configure_mode(mode: str) -> None:
    """``--portable-kernels`` as configured (called by the runtime: configuration flows down)."""
    _state["configured"] = _check(mode)


def set_mode(mode: str | None) -> None:
    """Override ``--portable-kernels`` (tests, benchmarks); None: back to the configured value."""
    _state["override"] = None if mode is None else _check(mode)


def mode() -> str:
    return _state["override"] or _state["configured"]


def _say_once(key: str, level: int, message: str) -> None:
    if key not in _state["said"]:
        _state["said"].add(key)
        _log.log(level, message)


def unavailable(device: torch.device) -> str | None:
    """Why kernels cannot be compiled for ``device`` here, or None.

    Asked on every kernel call: the answer is cached per device type and the environment it reads
    (looking for a C++ compiler on PATH cost ~50 us of ``stat`` calls per call, a measurable part of
    a step's host time wherever the device waits for the host)."""
    key = (device.type, os.environ.get("TORCHDYNAMO_DISABLE", ""), os.environ.get("CXX"), os.environ.get("PATH"))
    if key not in _unavailable:
        _unavailable[key] = _unavailable_uncached(device)
    return _unavailable[key]


_unavailable: dict[tuple, str | None] = {}


def _unavailable_uncached(device: torch.device) -> str | None:
    if os.environ.get("TORCHDYNAMO_DISABLE", "") not in ("", "0"):
        return "TORCHDYNAMO_DISABLE is set"
    if not torch._dynamo.is_dynamo_supported():
        return "TorchDynamo is not supported on this Python"
    if device.type == "cpu":
        if not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++", "c++")):
            return "no C++ compiler for Inductor's CPU code"
        return None
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        return None
    return f"Inductor has no code generator for {device.type}"


def active(x: torch.Tensor) -> bool:
    """Whether the compiled kernels serve ``x`` (the mode and this host)."""
    chosen = mode()
    if chosen == "eager":
        return False
    why = unavailable(x.device)
    if why is None:
        return True
    level = logging.WARNING if chosen == "compiled" else logging.INFO
    _say_once(
        f"unavailable-{x.device.type}",
        level,
        f"mindspeed_like: compiled portable kernels unavailable on {x.device.type} ({why}); the eager portable "
        "kernels run instead",
    )
    return False


_DYNAMIC_DIMS = {2: (0,), 4: (0, 1)}


def cpu_compile_options() -> dict[str, int]:
    """``{"cpp.simdlen": width}`` naming the vector ISA Inductor picks here, or {} where naming it
    would pick another ISA (two ISAs of one width, e.g. AMX before AVX-512 on a host without
    ``ATEN_CPU_CAPABILITY``) or Inductor is not importable.

    Inductor's C++ code is generated for the lanes of the ISA it picks (``ATEN_CPU_CAPABILITY``
    caps it) but its FX graph cache key does not include that ISA: under one cache directory a
    graph generated at one capability is reused, and its C++ compiled, at another. With the width
    given as a config value it is in the key (the config is hashed), and ``simdlen`` picks the
    same ISA as before (checked here), so nothing else changes."""
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return {}
    if inductor_config.cpp.simdlen is not None:  # the user named a width: it is in the key already
        return {}
    picked = cpu_vec_isa.pick_vec_isa()
    width = picked.bit_width()
    with inductor_config.patch({"cpp.simdlen": width}):
        again = cpu_vec_isa.pick_vec_isa()
    return {"cpp.simdlen": width} if str(again) == str(picked) else {}


def _compile(fn: Callable, device: torch.device) -> Callable:
    options = cpu_compile_options() if device.type == "cpu" else {}
    return torch.compile(fn, dynamic=False, fullgraph=True, options=options or None)


def _run(name: str, fn: Callable, *args):
    """``fn(*args)`` compiled once per dtype family, or eagerly after a compile failure.

    Only the row count (dim 0 of the 2-D tensors; sequence and batch, dims 0 and 1, of the 4-D
    ``[s, b, n, d]`` ones) is dynamic: the hidden size stays a constant of the generated code.
    Fully dynamic shapes (``dynamic=True``) measured 1.3-1.5x slower in the backward kernels
    here: symbolic inner sizes cost the vectorized loops."""
    key = (name, args[0].device.type)
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = _compiled[key] = _compile(fn, args[0].device)
    if compiled is fn:
        return fn(*args)
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() in _DYNAMIC_DIMS:
            for dim in _DYNAMIC_DIMS[arg.dim()]:
                if arg.shape[dim] > 1:  # a size-1 (broadcast) dimension stays specialized
                    torch._dynamo.maybe_mark_dynamic(arg, dim)
    try:
        return compiled(*args)
    except Exception as error:  # a compiler problem on this host: the math is the same eagerly
        _compiled[key] = fn
        _say_once(f"failed-{name}", logging.WARNING, f"mindspeed_like: compiling {name} failed ({error}); eager")
        return fn(*args)


# ---------------------------------------------------------------- the math (compiled bodies)


def swiglu_math(x: torch.Tensor) -> torch.Tensor:
    """``x [rows, 2h]``; Inductor computes low-precision inputs in fp32 and rounds once."""
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def swiglu_backward_math(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    sig = torch.sigmoid(a)
    return torch.cat([grad * sig * (1 + a * (1 - sig)) * b, grad * F.silu(a)], dim=-1)


def swiglu_bias_math(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return swiglu_math(x + bias)


def swiglu_bias_backward_math(grad, x, bias) -> torch.Tensor:
    """The gradient of ``x + bias`` (the bias gradient is its column sum, taken outside: ATen's
    column reduction measured faster than Inductor's here, and it sums what the eager kernel sums)."""
    return swiglu_backward_math(grad, x + bias)


def rms_norm_math(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, hidden]``, fp32 ``gamma [hidden]`` -> (y in x's dtype, fp32 rstd ``[rows, 1]``)."""
    xf = x.float()
    rstd = torch.rsqrt((xf * xf).mean(dim=1, keepdim=True) + eps)
    return (xf * rstd * gamma).to(x.dtype), rstd


def rms_norm_backward_math(grad, x, gamma, rstd) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, fp32 dgamma ``[hidden]``): the eager kernel's operations in its order
    (``kernels/rmsnorm.py`` ``rms_norm_backward``: megatron's autograd order, so non-finite
    values land where megatron's do)."""
    xf, g = x.float(), grad.float()
    grad_gamma = (g * (xf * rstd)).sum(dim=0)
    g_hat = g * gamma
    grad_mean = ((g_hat * xf).sum(dim=1, keepdim=True) * -0.5) * rstd.pow(3)
    grad_x_rstd = g_hat * rstd
    grad_x_pow = (grad_mean / x.shape[1]) * (xf * 2)
    return (grad_x_rstd + grad_x_pow).to(x.dtype), grad_gamma


def _rope_swap(x: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The rotate permutation without its sign (kernels/rope.py's ``_swap``)."""
    if interleave:
        return torch.stack((x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


def rope_math(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """``t [s, b, n, d]``, ``cos``/``signed_sin [s, 1|b, 1, rot]`` (rotate's sign folded into the
    sin): ``x * cos + swap(x) * signed_sin`` on the first ``rot`` channels, the rest passed on."""
    rot = cos.shape[-1]
    x = t[..., :rot]
    out = x * cos + _rope_swap(x, interleave) * signed_sin
    return torch.cat((out, t[..., rot:]), dim=-1) if rot < t.shape[-1] else out


def rope_backward_math(grad: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, interleave: bool):
    """The inverse rotation: ``g * cos + swap(g * signed_sin)`` (swap is its own transpose)."""
    rot = cos.shape[-1]
    g = grad[..., :rot]
    dx = g * cos + _rope_swap(g * signed_sin, interleave)
    return torch.cat((dx, grad[..., rot:]), dim=-1) if rot < grad.shape[-1] else dx


# ---------------------------------------------------------------- custom ops


@torch.library.custom_op("mindspeed_like::swiglu", mutates_args=())
def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` for ``a, b = chunk(x, 2, -1)``, any leading shape; saves only ``x``."""
    rows = x.reshape(-1, x.shape[-1])
    return _run("swiglu", swiglu_math, rows).view(*x.shape[:-1], x.shape[-1] // 2)


@swiglu.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("mindspeed_like::swiglu_backward", mutates_args=())
def swiglu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return _run("swiglu_backward", swiglu_backward_math, grad.reshape(rows.shape[0], -1), rows).view(x.shape)


@swiglu_backward.register_fake
def _(grad, x):
    return torch.empty_like(x)


def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _swiglu_grad(ctx, grad):
    (x,) = ctx.saved_tensors
    return swiglu_backward(grad.contiguous(), x)


swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


@torch.library.custom_op("mindspeed_like::swiglu_bias", mutates_args=())
def swiglu_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``swiglu(x + bias)`` (the sum never stored); saves ``x`` and ``bias``."""
    rows = x.reshape(-1, x.shape[-1])
    return _run("swiglu_bias", swiglu_bias_math, rows, bias).view(*x.shape[:-1], x.shape[-1] // 2)


@swiglu_bias.register_fake
def _(x, bias):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("mindspeed_like::swiglu_bias_backward", mutates_args=())
def swiglu_bias_backward(grad: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.reshape(-1, x.shape[-1])
    grad_x = _run("swiglu_bias_backward", swiglu_bias_backward_math, grad.reshape(rows.shape[0], -1), rows, bias)
    return grad_x.view(x.shape), grad_x.sum(dim=0).to(bias.dtype)


@swiglu_bias_backward.register_fake
def _(grad, x, bias):
    return torch.empty_like(x), torch.empty_like(bias)


def _swiglu_bias_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_bias_grad(ctx, grad):
    x, bias = ctx.saved_tensors
    return swiglu_bias_backward(grad.contiguous(), x, bias)


swiglu_bias.register_autograd(_swiglu_bias_grad, setup_context=_swiglu_bias_setup)


@torch.library.custom_op("mindspeed_like::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, hidden]``, fp32 ``gamma`` -> (y, fp32 rstd ``[rows, 1]``)."""
    return _run("rms_norm", rms_norm_math, x, gamma, eps)


@rms_norm.register_fake
def _(x, gamma, eps):
    return torch.empty_like(x), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@torch.library.custom_op("mindspeed_like::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _run("rms_norm_backward", rms_norm_backward_math, grad, x, gamma, rstd)


@rms_norm_backward.register_fake
def _(grad, x, gamma, rstd):
    return torch.empty_like(x), gamma.new_empty(gamma.shape, dtype=torch.float32)


def _rms_setup(ctx, inputs, output) -> None:
    x, gamma, _ = inputs
    ctx.save_for_backward(x, gamma, output[1])
    ctx.mark_non_differentiable(output[1])


def _rms_grad(ctx, grad_y, _grad_rstd):
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = rms_norm_backward(grad_y.contiguous(), x, gamma, rstd)
    return dx, dgamma.to(gamma.dtype), None


rms_norm.register_autograd(_rms_grad, setup_context=_rms_setup)


@torch.library.custom_op("mindspeed_like::rope", mutates_args=())
def rope(t: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE's ``half``/``interleave`` modes on ``[s, b, n, d]``; saves only the shared cos/sin."""
    return _run("rope", rope_math, t, cos, signed_sin, interleave).contiguous()  # as the fake says


@rope.register_fake
def _(t, cos, signed_sin, interleave):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


@torch.library.custom_op("mindspeed_like::rope_backward", mutates_args=())
def rope_backward(grad: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    return _run("rope_backward", rope_backward_math, grad, cos, signed_sin, interleave).contiguous()


@rope_backward.register_fake
def _(grad, cos, signed_sin, interleave):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _rope_setup(ctx, inputs, output) -> None:
    _, cos, signed_sin, ctx.interleave = inputs
    ctx.save_for_backward(cos, signed_sin)


def _rope_grad(ctx, grad):
    cos, signed_sin = ctx.saved_tensors
    return rope_backward(grad.contiguous(), cos, signed_sin, ctx.interleave), None, None, None


rope.register_autograd(_rope_grad, setup_context=_rope_setup)
