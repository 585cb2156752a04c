"""fp32 masters with every hard case of the bf16 + residual split, for the tests of
``kernels/bf16_residual.py`` and ``kernels/bf16_ties.py`` and of the features built on them."""

from __future__ import annotations

import torch


def hard_masters(n: int, seed: int) -> torch.Tensor:
    """Random fp32 masters with every hard case mixed in: exact ties (low half 0x8000 under even
    high halves, d = +32768, and odd ones, d = -32768), NaN, +-inf, subnormals, +-0 and the
    largest finite value (rounds up to +inf)."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    words = master.view(torch.int32)
    pick = torch.randint(0, 8, (n,), generator=g)
    words[pick == 0] = (words[pick == 0] & ~0x1FFFF) | 0x8000  # even high half: rounds down, d = +32768
    words[pick == 2] = (words[pick == 2] & ~0x1FFFF) | 0x18000  # odd high half: rounds up, d = -32768
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e-45, -3e-39, 0.0, -0.0, 3.4028235e38])
    chosen = torch.randint(0, len(specials), (n,), generator=g)
    master[pick == 1] = specials[chosen[pick == 1]]
    return master
