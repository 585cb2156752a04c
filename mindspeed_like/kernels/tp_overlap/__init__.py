"""Tensor-parallel linears with their communication overlapped with the matmul.

- ``column.ColumnParallelTiled`` / ``row.RowParallelTiled``: the token rows cut into tiles,
  each tile's collective under another tile's matmul (any device; ``schedules.py``).
- ``mc2.ColumnParallelMC2`` / ``mc2.RowParallelMC2``: torch_npu's fused kernels (NPU).

Never imports megatron: process groups and tensors only. ``ops.py`` is the seam through which
every matmul and collective of the tiled path runs (timeline tests, simulated-link benchmark).
"""
