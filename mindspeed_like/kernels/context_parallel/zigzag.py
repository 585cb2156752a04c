"""Megatron's load-balanced split: 2*CP chunks, rank r holding chunks r and 2*CP-1-r."""

from __future__ import annotations

import torch


def rank_chunks(rank: int, size: int) -> tuple[int, int]:
    return rank, 2 * size - 1 - rank


def gathered_to_natural(size: int) -> list[int]:
    """Chunk order of a rank-order gather (rank 0's two chunks, rank 1's, ...) -> natural order:
    ``natural[j]`` is the position in the gathered tensor of chunk ``j``."""
    gathered = [c for r in range(size) for c in rank_chunks(r, size)]
    return [gathered.index(j) for j in range(2 * size)]


def reorder_chunks(t: torch.Tensor, order: list[int], dim: int) -> torch.Tensor:
    """``t`` split in ``len(order)`` equal chunks along ``dim``, put together in ``order``."""
    chunks = t.chunk(len(order), dim=dim)
    return torch.cat([chunks[i] for i in order], dim=dim)


def inverse(order: list[int]) -> list[int]:
    return [order.index(i) for i in range(len(order))]
