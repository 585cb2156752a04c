"""CPU adapter, context parallelism: this CP rank's zigzag chunks of the rotary embedding and
(megatron-core 0.13) of the batch.

``models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank`` (0.13-0.19) and, in 0.13 only,
``utils.get_batch_on_this_cp_rank`` build their chunk index with
``torch.tensor(..., pin_memory=True).cuda(non_blocking=True)``: a CPU-only torch has no
pinned-memory allocator, and ``.cpu()`` takes no ``non_blocking`` (so no host twin can run them).
The replacements select the same chunks, ``r`` and ``2*CP-1-r`` of ``2*CP``, with the index on the
tensor's own device (0.14+ build the batch index that way themselves).
"""

from __future__ import annotations

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.targets import CORE


def _pos_emb_on_this_cp_rank(wrapped, instance, args, kwargs):
    return pos_emb_on_this_cp_rank(*args, **kwargs)


def pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    size, rank = cp_group.size(), cp_group.rank()
    return _zigzag(pos_emb, seq_dim, size, rank)


def _batch_on_this_cp_rank(wrapped, instance, args, kwargs):
    return batch_on_this_cp_rank(*args, **kwargs)


def _zigzag(t: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    index = torch.tensor([rank, 2 * size - rank - 1], device=t.device)
    chunks = t.view(*t.shape[:dim], 2 * size, -1, *t.shape[dim + 1 :])
    mine = chunks.index_select(dim, index)
    return mine.view(*mine.shape[:dim], -1, *mine.shape[dim + 2 :])


def batch_on_this_cp_rank(batch: dict, cp_group=None) -> dict:
    """megatron's split of a batch (sequence dim 1; 2 for ``attention_mask``), on the host."""
    from megatron.core import parallel_state

    if cp_group is not None:
        size, rank = cp_group.size(), cp_group.rank()
    else:
        size, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    if size > 1:
        for key, value in batch.items():
            if value is not None:
                batch[key] = _zigzag(value, 1 if key != "attention_mask" else 2, size, rank)
    return batch


PATCHES = [
    Patch(
        f"{CORE}.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank",
        Kind.WRAP,
        _pos_emb_on_this_cp_rank,
        why="pinned index moved with .cuda(non_blocking=True): the same chunks selected on the host",
    ),
    Patch(
        f"{CORE}.utils.get_batch_on_this_cp_rank",
        Kind.WRAP,
        _batch_on_this_cp_rank,
        versions="<0.14",
        why="0.13 pins its index tensor and moves it with .cuda(non_blocking=True): the same split on the host",
    ),
]
