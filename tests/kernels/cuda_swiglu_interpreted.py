"""Run by tests/kernels/test_cuda_swiglu_kernel.py in a fresh process with TRITON_INTERPRET=1: the
cuda backend's SwiGLU kernels on CPU tensors against float64 math, the compiled op's formulas for
non-finite inputs, and through ``kernels.swiglu.swiglu`` with the cuda backend forced."""

import torch
import torch.nn.functional as F

from mindspeed_like.kernels import compiled, swiglu
from mindspeed_like.kernels.backend import force_backend
from mindspeed_like.kernels.backends import cuda_swiglu

torch.manual_seed(0)
BOUND = {torch.float32: 1e-6, torch.bfloat16: 8e-3}  # fp32 math rounded once to the dtype
for dtype in (torch.float32, torch.bfloat16):
    for shape in [(3, 5, 2 * 7), (4, 2 * 1030), (1, 2), (2, 3, 2 * 2049)]:
        x = torch.randn(*shape, dtype=dtype, requires_grad=True)
        y = cuda_swiglu.TritonSwiGLU.apply(x)
        g = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, g)
        x64 = x.detach().double().requires_grad_()
        a, b = x64.chunk(2, -1)
        y64 = F.silu(a) * b
        (dx64,) = torch.autograd.grad(y64, x64, g.double())
        for got, want in ((y, y64), (dx, dx64)):
            assert got.dtype == dtype and got.shape == want.shape
            error = ((got.double() - want).norm() / want.norm()).item()
            assert error < BOUND[dtype], (dtype, shape, error)
# non-finite values land where the compiled op's formulas put them (issue 37: a fused kernel
# propagates NaN/inf as megatron's path does)
x = torch.tensor([[float("nan"), 1.0, 2.0, float("inf")], [1e30, -1e30, float("inf"), 0.0], [-88.0, 90.0, -1.0, 3.0]])
g = torch.ones(3, 2)
for got, want in (
    (cuda_swiglu.forward(x), compiled.swiglu_math(x)),
    (cuda_swiglu.backward(g, x), compiled.swiglu_backward_math(g, x)),
):
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), (got, want)
    finite = want.isfinite()
    assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=0), (got, want)
# the backend dispatch: forced cuda on CPU tensors takes the kernels once their check passed
assert cuda_swiglu.failed_check(torch.device("cpu")) is None
x = torch.randn(2, 3, 2 * 40, requires_grad=True)
with force_backend("cuda"):
    y = swiglu.swiglu(x)
assert type(y.grad_fn).__name__ == "TritonSwiGLUBackward", y.grad_fn
y.sum().backward()
assert x.grad is not None and x.grad.isfinite().all()
print("interpreted SwiGLU kernels: float64 bounds, non-finite placement, dispatch")
