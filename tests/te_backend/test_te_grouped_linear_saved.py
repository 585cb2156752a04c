"""The grouped linears that hold one weight per expert keep no stacked copy of the weights for
backward, and compute bitwise what they computed with one (``gmm(rows, torch.stack(weights))``):
the te-backend's ``TEGroupedLinear`` (megatron's TEGroupedMLP on the TE spec), the te-client
module's ``GroupedLinear`` and grouped-gemm's SequentialMLP stand-in (megatron-core 0.17+).

Before (stacked), every call kept a new ``[E, out, in]`` tensor to backward, and moe-alltoall-overlap,
which calls the experts once per local expert, kept E of them a linear (compare, moe 2L h256 EP 2 x DP 2
level 1: 16.5 MiB a layer)."""

from __future__ import annotations

import pytest
import torch

from mindspeed_like.kernels.grouped_gemm import gmm
from mindspeed_like.testing import init_parallel, tiny_gpt
from mindspeed_like.testing.parity import saved_storages

COUNTS = [([5, 0, 11, 0], "list"), ([0, 0, 16, 0], "tensor")]  # the second: one chunk of moe-alltoall-overlap


def _saved(module, x, counts):
    """The module's output and {storage address: bytes} of what autograd keeps to backward."""
    return saved_storages(lambda: module(x, counts))


def _stacked_path(x, weights, biases, counts):
    """What the modules computed before: the stacked weights through gmm, biases added per row."""
    out = gmm(x.reshape(-1, x.shape[-1]), torch.stack(weights), counts, trans_b=True)
    if biases:
        out = out + torch.repeat_interleave(torch.stack(biases), torch.tensor(counts), dim=0).to(out.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


def _check(module, weights, biases, counts, as_tensor, dtype):
    gen = torch.Generator().manual_seed(sum(counts) + len(weights))
    x0 = torch.randn(sum(counts), weights[0].shape[1], generator=gen).to(dtype)
    grad = torch.randn(sum(counts), weights[0].shape[0], generator=gen).to(dtype)
    x = x0.clone().requires_grad_(True)
    out, kept = _saved(module, x, torch.tensor(counts) if as_tensor else counts)
    out = out[0] if isinstance(out, tuple) else out
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    extra = {ptr: n for ptr, n in kept.items() if ptr not in params and ptr != x.untyped_storage().data_ptr()}
    stack = sum(w.numel() for w in weights) * weights[0].element_size()
    # no stacked weights: only the per-row bias index (int64 rows) where biases are added
    assert sum(extra.values()) == (8 * sum(counts) if biases else 0), extra
    assert all(n < stack for n in extra.values())
    out.backward(grad)
    got = [x.grad] + [p.grad for p in (*weights, *biases)]
    for p in (*weights, *biases):
        p.grad = None
    x_old = x0.clone().requires_grad_(True)
    out_old = _stacked_path(x_old, weights, biases, counts)
    out_old.backward(grad)
    assert torch.equal(out, out_old)
    for g, want in zip(got, [x_old.grad] + [p.grad for p in (*weights, *biases)]):
        assert torch.equal(g, want)
    for e, count in enumerate(counts):
        if count == 0:
            assert torch.count_nonzero(weights[e].grad) == 0


@pytest.mark.parametrize("counts,kind", COUNTS, ids=[k for _, k in COUNTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_te_backend_grouped_linear(cpu_config, counts, kind, dtype):
    cpu_config()
    init_parallel(seed=1)
    model = tiny_gpt(transformer_impl="transformer_engine", num_moe_experts=4, moe_grouped_gemm=True)
    for name in ("linear_fc1", "linear_fc2"):
        module = next(m for n, m in model.named_modules() if n.endswith(f"experts.{name}")).to(dtype)
        _check(module, module.weights(), [], counts, kind == "tensor", dtype)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("counts,kind", COUNTS, ids=[k for _, k in COUNTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_te_client_grouped_linear(counts, kind, dtype, bias):
    from mindspeed_like.te_shim.modules import GroupedLinear

    module = GroupedLinear(4, 32, 24, bias=bias, device="cpu", params_dtype=dtype)
    with torch.no_grad():
        for e in range(4):
            getattr(module, f"bias{e}", torch.empty(0)).normal_()
    weights = [getattr(module, f"weight{e}") for e in range(4)]
    biases = [getattr(module, f"bias{e}") for e in range(4)] if bias else []
    _check(module, weights, biases, counts, kind == "tensor", dtype)


@pytest.mark.parametrize("counts,kind", COUNTS, ids=[k for _, k in COUNTS])
def test_sequential_experts_grouped_linear(counts, kind):
    """grouped-gemm's stand-in for SequentialMLP's expert linears (megatron-core 0.17+), standalone."""
    from mindspeed_like.features.grouped_gemm.ops import GroupedGemmOps
    from mindspeed_like.features.grouped_gemm.sequential import GroupedLinear
    from mindspeed_like.toolkit.fallback import Fallback

    weights = [torch.nn.Parameter(torch.randn(24, 32)) for _ in range(4)]
    ops = GroupedGemmOps("off", Fallback("grouped-gemm", strict=False))

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = torch.nn.ParameterList(weights)

        def forward(self, x, counts):
            return GroupedLinear(ops.gmm_experts, list(self.weights), torch.as_tensor(counts))(x)

    _check(Module(), weights, [], counts, kind == "tensor", torch.float32)
