"""Spawned gloo processes for test_uneven_gather.py (importable by the children)."""

from __future__ import annotations

import torch


def _pieces(rank: int) -> torch.Tensor:
    """Rank ``r`` holds ``r + 2`` rows of 3 values, each row telling its rank and index."""
    return (100.0 * rank + torch.arange(3.0 * (rank + 2))).reshape(rank + 2, 3)


def gather_uneven(with_patch: bool) -> dict:
    """megatron's ``_gather_along_first_dim`` and ``gather_from_sequence_parallel_region`` (forward and
    backward) with uneven ``output_split_sizes`` over the world, with the cpu adapter's patch, or as the
    plain host twin (what ran before): its error."""
    import mindspeed_like

    mindspeed_like.configure(device="cpu")
    from megatron.core.tensor_parallel import mappings

    from mindspeed_like.adapters.cpu.host_view import run_on_host

    group = torch.distributed.group.WORLD
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    sizes = [r + 2 for r in range(world)]
    piece = _pieces(rank)
    if not with_patch:
        original = mappings._gather_along_first_dim.__wrapped__
        try:
            run_on_host(original, None, (piece, group), {"output_split_sizes": sizes})
        except RuntimeError as error:
            return {"error": str(error)}
        return {"error": None}
    gathered = mappings._gather_along_first_dim(piece, group, output_split_sizes=sizes)
    leaf = piece.clone().requires_grad_(True)
    out = mappings.gather_from_sequence_parallel_region(leaf, group=group, output_split_sizes=sizes)
    weights = torch.arange(float(out.numel())).reshape(out.shape)
    (out * weights).sum().backward()
    return {
        "gathered": gathered.tolist(),  # lists: tensors through the result queue outlive their process
        "expected": torch.cat([_pieces(r) for r in range(world)]).tolist(),
        "grad": leaf.grad.tolist(),
        "weights": weights.tolist(),
        "sizes": sizes,
        "rank": rank,
    }
