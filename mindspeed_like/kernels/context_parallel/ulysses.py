"""Ulysses (MindSpeed's ``ulysses_cp_algo``): an all-to-all turns "all heads, my sequence chunks"
into "my share of the heads, the whole sequence"; attention runs on the whole sequence; a second
all-to-all turns it back. Heads and K/V groups must divide by the CP size (checked by the caller
with the numbers); GQA keys and values travel unexpanded (their own groups split over the ranks)
and the backend's whole-sequence attention takes them as they are (torch's SDPA with ``enable_gqa``,
or ``npu_fusion_attention`` on the npu backend). The gathered sequence is megatron's zigzag chunk order;
it is put in natural order for the causal attention and back afterwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mindspeed_like.kernels.attention_dropout import AttentionDropout
from mindspeed_like.kernels.context_parallel.blocks import full_attention
from mindspeed_like.kernels.context_parallel.groups import CPGroup
from mindspeed_like.kernels.context_parallel.zigzag import gathered_to_natural, inverse, reorder_chunks


def _all_to_all(t: torch.Tensor, cp: CPGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``t`` in CP parts along ``scatter_dim``, part j to rank j; the parts received from
    all ranks concatenated along ``gather_dim`` in rank order."""
    parts = [p.contiguous() for p in t.chunk(cp.size, dim=scatter_dim)]
    received = [torch.empty_like(parts[0]) for _ in range(cp.size)]
    dist.all_to_all(received, parts, group=cp.group)
    return torch.cat(received, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cp: CPGroup, scatter_dim: int, gather_dim: int):
        ctx.cp, ctx.dims = cp, (scatter_dim, gather_dim)
        return _all_to_all(t, cp, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad.contiguous(), ctx.cp, gather_dim, scatter_dim), None, None, None


def check_divisible(heads: int, groups: int, degree: int, what: str) -> None:
    if heads % degree or groups % degree:
        raise ValueError(
            f"Ulysses context parallelism splits heads over the ranks: {heads} attention heads and "
            f"{groups} key/value groups per TP rank must both divide by {what}={degree}; use "
            "--context-parallel-algo megatron_cp_algo (ring) or kvallgather_cp_algo for this model"
        )


def ulysses_attention(
    q, k, v, cp: CPGroup, *, causal: bool, scale: float, dropout: AttentionDropout | None = None
) -> torch.Tensor:
    """``q [b, n, 2c, d]``, ``k/v [b, groups, 2c, d]`` (zigzag chunks) -> ``[b, n, 2c, d]``."""
    heads, groups = q.shape[1], k.shape[1]
    check_divisible(heads, groups, cp.size, "CP")
    to_natural = gathered_to_natural(cp.size)
    whole = []
    for t in (q, k, v):
        t = _AllToAll.apply(t, cp, 1, 2)  # heads scattered, sequence gathered (rank order)
        whole.append(reorder_chunks(t, to_natural, dim=2))
    masks = dropout.masks(q.device, cp.rank) if dropout else None
    out = full_attention(*whole, causal, scale, masks)
    out = reorder_chunks(out, inverse(to_natural), dim=2)
    return _AllToAll.apply(out, cp, 2, 1)
