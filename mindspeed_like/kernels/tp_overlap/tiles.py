"""How the token dimension is cut into tiles, and the row orders that result.

Tiles are contiguous row ranges of the *local* token dimension (all leading dims flattened:
``[s, b, h]`` -> ``[s * b, h]``). Sizes differ by at most one row (``torch.tensor_split``
rule), so token counts that do not divide by the tile count are handled exactly instead of
being refused.

Megatron's sequence-parallel layout is rank-major: the gathered ``[tp * M_local, ...]``
tensor holds rank 0's rows, then rank 1's. Gathering tile ``c`` of every rank yields
``[tp, rows_c, ...]``, i.e. the rows of that tile from all ranks. Viewing megatron's gathered
tensor as ``[tp, M_local, ...]``, tile ``c`` is the column slice ``[:, lo_c:hi_c]``; writing
each tile's result there puts rows back in megatron's order, and reading it there
pre-arranges a reduce-scatter's input so each rank's sum lands where megatron puts it.
"""

from __future__ import annotations


def tile_bounds(rows: int, tiles: int) -> list[tuple[int, int]]:
    """``tiles`` contiguous ranges covering ``range(rows)``; sizes differ by at most one."""
    if tiles < 1 or rows < tiles:
        raise ValueError(f"cannot cut {rows} rows into {tiles} non-empty tiles")
    base, extra = divmod(rows, tiles)
    bounds, lo = [], 0
    for index in range(tiles):
        hi = lo + base + (1 if index < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds
