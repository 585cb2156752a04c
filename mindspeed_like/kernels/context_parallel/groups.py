"""The CP process group as the algorithms need it: size, rank, ring neighbours (global ranks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CPGroup:
    group: object
    ranks: tuple[int, ...]  # global ranks, in CP-rank order

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(dist.get_rank())

    def ring_exchange(self, tensor: torch.Tensor) -> tuple[list, torch.Tensor]:
        """Start sending ``tensor`` to the next rank and receiving the previous rank's; returns
        the requests and the buffer being received into."""
        if self.size == 1:  # a ring of one (hybrid with the whole CP group as Ulysses group)
            return [], tensor
        received = torch.empty_like(tensor)
        nxt = self.ranks[(self.rank + 1) % self.size]
        prev = self.ranks[(self.rank - 1) % self.size]
        requests = [
            dist.isend(tensor.contiguous(), nxt, group=self.group),
            dist.irecv(received, prev, group=self.group),
        ]
        return requests, received


def wait(requests: list) -> None:
    for request in requests:
        request.wait()
