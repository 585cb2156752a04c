"""CPU adapter, context parallelism: the rotary embedding of this CP rank's zigzag chunks.

``models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank`` (0.13-0.19) builds its chunk
index with ``torch.tensor(..., pin_memory=True).cuda(non_blocking=True)``: a CPU-only torch has no
pinned-memory allocator, and ``.cpu()`` takes no ``non_blocking`` (so no host twin can run it). The
replacement selects the same chunks, ``r`` and ``2*CP-1-r`` of ``2*CP``, with the index on the
embedding's own device.
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
    index = torch.tensor([rank, 2 * size - rank - 1], device=pos_emb.device)
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1 :])
    mine = chunks.index_select(seq_dim, index)
    return mine.view(*mine.shape[:seq_dim], -1, *mine.shape[seq_dim + 2 :])


PATCHES = [
    Patch(
        f"{CORE}.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank",
        Kind.WRAP,
        _pos_emb_on_this_cp_rank,
        why="pinned index moved with .cuda(non_blocking=True): the same chunks selected on the host",
    )
]
