"""Attention dropout drawn block by block, for the kernels that never hold a whole row's scores:
the context-parallel kernels (``kernels/context_parallel``) and the blocked kernel
(``kernels/blocked_attention.py``, a CPU host's flash attention under dropout).

Dropout acts on the normalized probabilities: ``out = sum_j (P_j * m_j / keep) V_j``. Since a
block's partial output is rescaled linearly by the log-sum-exp merge, each block can apply its
own slice of the mask to its un-normalized probabilities and the merged result is exactly
dropout of the whole row's softmax. The backward regenerates every block's mask: one generator,
seeded once per forward (the caller draws the seed out of megatron's RNG tracker, so
``--seed``, TP ranks and recompute behave as megatron's own dropout), drawn block by block in the
same order forward and backward (every algorithm visits its blocks in the same order both ways).
The CP rank is mixed into the seed so the ranks' blocks draw independent masks (the blocked
kernel passes rank 0).
Gradient, with ``P`` from the merged log-sum-exp and ``D = rowsum(dout * out)`` of the final
output: ``dV = (P m / keep)^T dout``, ``dP = (dout V^T) m / keep``, ``dS = P (dP - D)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio odd constant: spreads consecutive CP ranks over the seed space


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout probability ``p`` and the seed of one forward's masks."""

    p: float
    seed: int

    def __post_init__(self) -> None:
        if not 0.0 < self.p < 1.0:
            raise ValueError(f"attention dropout probability must be in (0, 1), got {self.p}")

    @property
    def keep(self) -> float:
        return 1.0 - self.p

    @classmethod
    def draw(cls, p: float, device: torch.device) -> AttentionDropout:
        """A seed from the current generator of ``device`` (the caller's RNG context decides which:
        inside megatron's tracker fork, the tracker's state)."""
        return cls(p, int(torch.randint(0, 2**62, (1,), device=device).item()))

    def masks(self, device: torch.device, rank: int = 0) -> MaskStream:
        """A fresh stream of this forward's block masks for CP rank ``rank`` (forward and backward)."""
        return MaskStream(self, device, (self.seed + rank * _MIX) % (2**63))


class MaskStream:
    """Keep-masks (True = kept) of successive blocks, reproducible from the seed."""

    def __init__(self, dropout: AttentionDropout, device: torch.device, seed: int) -> None:
        self.keep = dropout.keep
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def next(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, device=self.device) < self.keep
