"""kernels/indices_multihot.py: megatron's fused_indices_to_multihot contract in torch operations,
against a float64 reference built entry by entry (forward and the probs' gradient), with ignored
indices (-1, other ranks' experts), and through the cpu adapter where megatron's name is bound."""

from __future__ import annotations

import pytest
import torch

import mindspeed_like
from mindspeed_like.kernels.indices_multihot import indices_to_multihot


def _routing(tokens: int, topk: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k indices over ``2 * experts`` global experts (half of them another rank's), some -1."""
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(2 * experts, generator=g)[:topk] for _ in range(tokens)]).int()
    indices[torch.rand(tokens, topk, generator=g) < 0.2] = -1
    return indices, torch.rand(tokens, topk, generator=g)


def _reference(indices, probs, experts, weights):
    """Entry by entry in float64: the multihot map, its probs, and d(sum(weights * probs_in_multihot))."""
    tokens, topk = indices.shape
    multihot = torch.zeros(tokens, experts, dtype=torch.bool)
    dense = torch.zeros(tokens, experts, dtype=torch.float64)
    grad = torch.zeros(tokens, topk, dtype=torch.float64)
    for t in range(tokens):
        for k in range(topk):
            e = int(indices[t, k])
            if 0 <= e < experts:
                multihot[t, e] = True
                dense[t, e] = float(probs[t, k])
                grad[t, k] = float(weights[t, e])
    return multihot, dense, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("tokens", "topk", "experts"), [(1, 1, 1), (7, 2, 4), (33, 6, 7), (64, 8, 30)])
def test_matches_the_float64_reference(dtype, tokens, topk, experts):
    indices, probs = _routing(tokens, topk, experts, seed=tokens + topk)
    probs = probs.to(dtype).requires_grad_()
    multihot, dense = indices_to_multihot(indices, probs, experts)
    weights = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(3)).to(dtype)
    (dense * weights).sum().backward()
    ref_multihot, ref_dense, ref_grad = _reference(indices, probs.detach(), experts, weights)
    assert multihot.dtype == torch.bool and torch.equal(multihot, ref_multihot)
    assert dense.dtype == dtype and torch.equal(dense.double(), ref_dense)  # a copy: exact
    assert torch.equal(probs.grad.double(), ref_grad)  # a gather: exact


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="must have the same shape"):
        indices_to_multihot(torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 1), 4)


def test_the_cpu_adapter_binds_it_where_megatron_and_its_dispatcher_take_the_name():
    mindspeed_like.reset()
    try:
        mindspeed_like.configure(device="cpu")
        from megatron.core.fusions import fused_indices_converter
        from megatron.core.transformer.moe import token_dispatcher

        indices, probs = _routing(5, 2, 4, seed=0)
        for fn in (fused_indices_converter.fused_indices_to_multihot, token_dispatcher.fused_indices_to_multihot):
            multihot, dense = fn(indices, probs, 4)
            assert torch.equal(multihot, _reference(indices, probs, 4, torch.zeros(5, 4))[0])
    finally:
        mindspeed_like.reset()
    from megatron.core.fusions import fused_indices_converter

    assert fused_indices_converter.fused_indices_to_multihot.__module__ == fused_indices_converter.__name__
