"""Expert row counts rounded up to a bounded set of sizes, for a CPU's bf16/fp16 GEMMs.

Why: torch's CPU bf16/fp16 matmul runs oneDNN's brgemm, which builds (JIT-compiles) a kernel for
each problem shape and keeps it: in a primitive cache of 1,024 entries, and in caches below it
that the primitive cache's capacity does not bound (``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`` halves
the growth, it does not stop it). An MoE step gives every expert a data-dependent token count, so
each step brings new GEMM shapes and the process's heap grows with them. Measured on this host
(torch 2.13.0+cpu, oneDNN 3.12, one thread): a bf16 ``[m, 256] x [256, 1408]`` GEMM for 1,000
random ``m`` in 1..2,000 grew glibc's in-use bytes by 409 MiB (199 MiB with the primitive cache
off); with ``m`` rounded up as below, by 41 MiB in the same time. A 2-layer DeepSeek-preset compare run grew about
35 MiB a step in both arms (its experts' grouped GEMMs), with no plateau in 8 steps.

Rounding each count up to one of 8 sizes per octave (at least 16 rows; at most 12.5% more rows,
zeros) leaves 57 shapes for counts up to 2,000 and 8 more per doubling. The zero rows change no
real row of the product (rows are independent) and add exact zeros to the weight gradient's
reduction: the results are bitwise those of the unpadded GEMM (tests/kernels check it). The cost
is a copy of the rows into the padded layout and the extra rows' FLOPs; the saved tensors are the
unpadded ones.

fp32 (MKL's sgemm) and an accelerator's GEMMs keep no such per-shape state: unchanged there, and
on a host whose bf16 GEMMs run in fp32 (:func:`shapes_are_cached`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_ROWS = 16
SIZES_PER_OCTAVE = 8
_CACHED_SHAPE_DTYPES = (torch.bfloat16, torch.float16)


def bucket(count: int) -> int:
    """The row count a GEMM of ``count`` rows runs at: 0 stays 0, 1..16 -> 16, then rounded up
    to a multiple of ``2**floor(log2(count)) / 8`` (idempotent: a bucket is its own bucket)."""
    if count <= 0:
        return 0
    if count <= MIN_ROWS:
        return MIN_ROWS
    step = max(1, (1 << (count.bit_length() - 1)) // SIZES_PER_OCTAVE)
    return -(-count // step) * step


def shapes_are_cached(t: torch.Tensor) -> bool:
    """Whether GEMMs on ``t`` go through a library that keeps state per shape (a CPU's oneDNN
    bf16/fp16 matmul). Not where this host's bf16 GEMMs run in fp32 (no bf16 units, or torch held
    below them: kernels/host_gemm.py's probe): MKL's sgemm keeps no per-shape state, and the padded
    rows would be FLOPs and copies for nothing."""
    if t.device.type != "cpu" or t.dtype not in _CACHED_SHAPE_DTYPES:
        return False
    from mindspeed_like.kernels.host_gemm import low_precision_gemm_is_slow

    return not low_precision_gemm_is_slow(t.dtype)


@dataclass(frozen=True)
class RowBuckets:
    """The padded layout of a grouped GEMM's rows: expert ``e``'s ``counts[e]`` rows first in
    its block of ``padded[e]``; ``rows`` is where each real row goes."""

    counts: list[int]
    padded: list[int]
    rows: torch.Tensor

    @classmethod
    def of(cls, counts: Sequence[int], device: torch.device) -> RowBuckets | None:
        """The layout, or None when every count already is a bucket (nothing to pad)."""
        padded = [bucket(c) for c in counts]
        if padded == list(counts):
            return None
        gaps = torch.tensor([p - c for p, c in zip(padded, counts)], dtype=torch.int64)
        before = torch.cumsum(gaps, 0) - gaps  # padding rows ahead of each expert's block
        real = torch.tensor(list(counts), dtype=torch.int64)
        rows = torch.arange(int(real.sum()), dtype=torch.int64) + torch.repeat_interleave(before, real)
        return cls(list(counts), padded, rows.to(device))

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s rows in the padded layout, zeros between."""
        out = t.new_zeros(sum(self.padded), *t.shape[1:])
        return out.index_copy_(0, self.rows, t)

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """The real rows of a padded result, in the unpadded order."""
        return t.index_select(0, self.rows)


def row_buckets(t: torch.Tensor, counts: Sequence[int]) -> RowBuckets | None:
    """The padded layout for a grouped GEMM over ``t``'s rows, where its shapes are cached."""
    return RowBuckets.of(counts, t.device) if shapes_are_cached(t) else None
