"""The rectangular blocks that describe a DP rank's flat range of a parameter (model-space fix)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mindspeed_like.fixes.distopt_model_space_checkpoint import flat_range_blocks

SHAPES = [(7,), (3, 5), (4, 1), (1, 6), (2, 3, 4), (3, 2, 2, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_blocks_cover_exactly_the_flat_range_in_order(shape):
    numel = math.prod(shape)
    flat = torch.arange(numel)
    full = flat.view(shape)
    for start, end in itertools.combinations(range(numel + 1), 2):
        blocks = flat_range_blocks(shape, start, end)
        assert len(blocks) <= 2 * len(shape) - 1
        pieces = []
        for offset, size in blocks:
            index = tuple(slice(o, o + s) for o, s in zip(offset, size))
            pieces.append(full[index].reshape(-1))
        # concatenated in order, the blocks are the range itself: each is contiguous, none overlaps
        assert torch.equal(torch.cat(pieces), flat[start:end]), (shape, start, end, blocks)


@pytest.mark.parametrize("start, end", [(0, 0), (3, 2), (-1, 2), (0, 16)])
def test_empty_or_outside_range_is_refused(start, end):
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        flat_range_blocks((3, 5), start, end)
