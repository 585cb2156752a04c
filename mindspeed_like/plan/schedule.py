"""How many microbatches' activations a pipeline rank holds at once, per megatron's schedules.

- No pipeline (PP = 1): one microbatch at a time (each one's backward runs before the next forward).
- 1F1B (``forward_backward_pipelining_without_interleaving``): rank r runs ``PP - r - 1`` warm-up
  forwards, then one forward per backward: ``min(PP - r, M)`` in flight.
- Interleaved (``..._with_interleaving``, V model chunks per rank): warm-up
  ``(PP - r - 1) x 2 + (V - 1) x PP`` chunk-forwards (``microbatch_group_size_per_vp_stage`` = PP),
  all ``M x V`` when that reaches them, then one more before the first backward: the chunks in
  flight are the first ``min(warm-up + 1, M x V)`` of the forward order (chunk ``(k // PP) % V``
  for the k-th forward).
"""

from __future__ import annotations

from collections import Counter


def in_flight_1f1b(pp: int, rank: int, microbatches: int) -> int:
    return min(pp - rank, microbatches) if pp > 1 else 1


def interleaved_warmup(pp: int, rank: int, chunks: int, microbatches: int) -> int:
    total = microbatches * chunks
    warmup = (pp - rank - 1) * 2 + (chunks - 1) * pp
    return min(warmup, total)


def in_flight_chunks(pp: int, rank: int, chunks: int, microbatches: int) -> dict[int, int]:
    """model chunk -> microbatches of it whose activations are held at the rank's peak."""
    if pp == 1:
        return {0: 1}
    if chunks == 1:
        return {0: in_flight_1f1b(pp, rank, microbatches)}
    total = microbatches * chunks
    held = min(interleaved_warmup(pp, rank, chunks, microbatches) + 1, total)
    counts = Counter((k // pp) % chunks for k in range(held))
    return {c: counts.get(c, 0) for c in range(chunks)}


def last_forward_chunk(pp: int, chunks: int, microbatches: int) -> int:
    """The model chunk of a rank's last forward in a step (what compare's activation probe keeps)."""
    if chunks == 1:
        return 0
    return ((microbatches * chunks - 1) // pp) % chunks
