"""kernels/pad_routing_map.py: megatron's fused_pad_routing_map contract in torch operations, against a
reference built token by token, against megatron's unfused ``pad_routing_map``, and through the cpu adapter
where megatron's name is bound (the Triton kernel it replaces needs a GPU)."""

from __future__ import annotations

import pytest
import torch

import mindspeed_like
from mindspeed_like.kernels.pad_routing_map import pad_routing_map


def _routing_map(tokens: int, experts: int, topk: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    return torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)


def _reference(routing_map: torch.Tensor, pad_multiple: int) -> torch.Tensor:
    """Expert by expert, token by token: route the first unrouted tokens until the count is a multiple."""
    tokens, experts = routing_map.shape
    out = routing_map.int().tolist()
    for e in range(experts):
        count = sum(out[t][e] for t in range(tokens))
        for t in range(tokens):
            if count % pad_multiple == 0:
                break
            if out[t][e] == 0:
                out[t][e], count = 1, count + 1
    return torch.tensor(out, dtype=torch.int32).reshape(tokens, experts)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int64], ids=["bool", "int32", "int64"])
@pytest.mark.parametrize(
    ("tokens", "experts", "topk", "pad"), [(1, 1, 1, 1), (7, 4, 2, 4), (32, 8, 2, 16), (33, 7, 3, 8), (5, 3, 1, 16)]
)
def test_matches_the_token_by_token_reference(dtype, tokens, experts, topk, pad):
    routing_map = _routing_map(tokens, experts, topk, seed=tokens + experts).to(dtype)
    before = routing_map.clone()
    padded = pad_routing_map(routing_map, pad)
    assert padded.dtype == torch.int32 and padded.shape == (tokens, experts)
    assert torch.equal(padded, _reference(routing_map, pad))
    assert padded.transpose(0, 1).is_contiguous()  # the kernel's layout: a transposed [experts, tokens]
    assert torch.equal(routing_map, before)  # the input is not written
    counts = padded.sum(dim=0)
    assert bool(((counts % pad == 0) | (counts == tokens)).all())  # short only where every token is routed


def test_equals_megatrons_unfused_padding():
    from megatron.core.transformer.moe.moe_utils import pad_routing_map as megatron_pad

    routing_map = _routing_map(64, 8, 2, seed=5)
    assert torch.equal(pad_routing_map(routing_map, 16), megatron_pad(routing_map.clone(), 16).int())


def test_no_tokens_returns_the_input_and_bad_arguments_are_refused():
    empty = torch.zeros(0, 4, dtype=torch.bool)
    assert pad_routing_map(empty, 16) is empty
    with pytest.raises(ValueError, match=r"\[tokens, experts\]"):
        pad_routing_map(torch.zeros(4, dtype=torch.bool), 16)
    with pytest.raises(ValueError, match="pad_multiple must be a positive integer"):
        pad_routing_map(torch.zeros(4, 2, dtype=torch.bool), 0)


def test_the_cpu_adapter_binds_it_where_megatron_and_its_dispatcher_take_the_name():
    mindspeed_like.reset()
    try:
        mindspeed_like.configure(device="cpu")
        from megatron.core.fusions import fused_pad_routing_map
        from megatron.core.transformer.moe import token_dispatcher

        routing_map = _routing_map(9, 4, 2, seed=1)
        for fn in (fused_pad_routing_map.fused_pad_routing_map, token_dispatcher.fused_pad_routing_map):
            assert torch.equal(fn(routing_map, 4), _reference(routing_map, 4))
    finally:
        mindspeed_like.reset()
    from megatron.core.fusions import fused_pad_routing_map

    assert fused_pad_routing_map.fused_pad_routing_map.__module__ == fused_pad_routing_map.__name__
