"""The ``cuda`` backend of SwiGLU (``kernels/swiglu.py``): one Triton kernel forward, one backward.

Why hand-written Triton rather than the compiled portable op: on a GPU the training step of a
model of a few billion parameters waits on the host (the first H100 run: 38 ms of device work in
a 92 ms step at level 2), and a ``torch.compile``'d function pays TorchDynamo's frame evaluation,
its guards and AOTAutograd's runtime wrappers on every call, several times a bare kernel launch.
These kernels do what the compiled op does (the same formulas as ``compiled.swiglu_math`` /
``swiglu_backward_math``, in fp32, rounded once to the input's dtype) behind a plain
``autograd.Function``: one launch each way, each element read and written once.

``x`` is ``[rows, 2h]`` with rows contiguous (a ``[s, b, 2h]`` activation viewed as rows): ``a``
is the first half of a row, ``b`` the second. A launch grid of (rows, column blocks); no host
sync, no data-dependent shape. With ``TRITON_INTERPRET=1`` set before triton is imported the
kernels run on CPU tensors in Triton's interpreter (how tests/kernels checks them on a host).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every CUDA build of torch ships triton
    triton = None

BLOCK = 1024  # columns of a half-row per program
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension


def unavailable() -> str | None:
    """Why the kernels cannot run here, or None."""
    return "triton is not installed" if triton is None else None


if triton is not None:

    @triton.jit(do_not_specialize=["half"])
    def _forward_kernel(x_ptr, y_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < half
        a = tl.load(x_ptr + row * 2 * half + cols, mask=live, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * 2 * half + half + cols, mask=live, other=0.0).to(tl.float32)
        y = a * tl.sigmoid(a) * b
        tl.store(y_ptr + row * half + cols, y.to(y_ptr.dtype.element_ty), mask=live)

    @triton.jit(do_not_specialize=["half"])
    def _backward_kernel(g_ptr, x_ptr, dx_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < half
        g = tl.load(g_ptr + row * half + cols, mask=live, other=0.0).to(tl.float32)
        a = tl.load(x_ptr + row * 2 * half + cols, mask=live, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + row * 2 * half + half + cols, mask=live, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        da = g * sig * (1 + a * (1 - sig)) * b
        db = g * (a * sig)
        tl.store(dx_ptr + row * 2 * half + cols, da.to(dx_ptr.dtype.element_ty), mask=live)
        tl.store(dx_ptr + row * 2 * half + half + cols, db.to(dx_ptr.dtype.element_ty), mask=live)


def _grid(rows: int, half: int) -> tuple[int, int]:
    return rows, triton.cdiv(half, BLOCK)


def fits(x: torch.Tensor) -> bool:
    """Shapes these kernels take: a non-empty last dim of even size whose column blocks fit the grid.
    Asked before ``failed_check``, so it needs no triton (without it the check says why, once)."""
    half = x.shape[-1] // 2
    return x.numel() > 0 and half > 0 and -(-half // BLOCK) <= MAX_GRID_Y


def forward(x: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` of ``x [..., 2h]``; fp32 math, rounded once to x's dtype."""
    half = x.shape[-1] // 2
    rows = x.numel() // (2 * half)
    x2 = x.reshape(rows, 2 * half).contiguous()
    y = torch.empty((rows, half), dtype=x.dtype, device=x.device)
    _forward_kernel[_grid(rows, half)](x2, y, half, BLOCK=BLOCK)
    return y.reshape(*x.shape[:-1], half)


def backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d(silu(a) * b) for ``x = [a, b]`` and the output gradient ``grad``, in x's dtype."""
    half = x.shape[-1] // 2
    rows = x.numel() // (2 * half)
    x2 = x.reshape(rows, 2 * half).contiguous()
    g2 = grad.reshape(rows, half).contiguous()
    dx = torch.empty((rows, 2 * half), dtype=x.dtype, device=x.device)
    _backward_kernel[_grid(rows, half)](g2, x2, dx, half, BLOCK=BLOCK)
    return dx.reshape(x.shape)


class TritonSwiGLU(torch.autograd.Function):
    """Saves ``x`` only, as the portable op does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return forward(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        return backward(grad, x)


_checked: dict[str, str | None] = {}


def failed_check(device: torch.device) -> str | None:
    """Why these kernels must not serve ``device`` (None: they may), decided once per device: both
    kernels run on a small odd-sized input and must match the fp32 math within fp32 rounding. A
    compile or launch error, or a difference, is the reason (the caller logs it and runs the
    portable op): a user's run never depends on an unverified kernel."""
    key = str(device)
    if key not in _checked:
        _checked[key] = unavailable() or _check(device)
    return _checked[key]


def _check(device: torch.device) -> str | None:
    import torch.nn.functional as F

    try:
        generator = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(3, 2 * 1030, generator=generator).to(device)
        g = torch.randn(3, 1030, generator=generator).to(device)
        y, dx = forward(x), backward(g, x)
        a, b = x.double().chunk(2, dim=-1)
        sig = torch.sigmoid(a)
        want_y = F.silu(a) * b
        want_dx = torch.cat([g.double() * sig * (1 + a * (1 - sig)) * b, g.double() * F.silu(a)], dim=-1)
        for got, want in ((y, want_y), (dx, want_dx)):
            error = ((got.double() - want).norm() / want.norm()).item()
            if not error < 1e-6:
                return f"the Triton SwiGLU differs from the fp32 math on {device} (relative error {error:.2e})"
    except Exception as error:  # a compiler or driver problem: the portable op runs instead
        return f"the Triton SwiGLU kernels failed on {device} ({type(error).__name__}: {error})"
    return None
