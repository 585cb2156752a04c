"""How many microbatches' activations a pipeline rank holds at once, per megatron's schedules
(``megatron/core/pipeline_parallel/schedules.py``, written here without importing it; the tests
compare with megatron's own ``get_pp_rank_microbatches`` and ``get_schedule_table``).

- No pipeline (PP = 1): one microbatch at a time (each one's backward runs before the next forward).
- 1F1B (``forward_backward_pipelining_without_interleaving``): rank r runs ``PP - r - 1`` warm-up
  forwards, then one forward per backward: ``min(PP - r, M)`` in flight.
- Interleaved (``..._with_interleaving``, V model chunks per rank): ``(PP - r - 1) x 2 + (V - 1) x
  G`` warm-up chunk-forwards (G = ``microbatch_group_size_per_vp_stage``, PP by default), all
  ``M x V`` when that reaches them, then one forward per backward; which chunk each forward runs is
  megatron's schedule table (groups of G microbatches, chunk by chunk), and the k-th backward runs
  the k-th entry's microbatch on chunk ``V - 1 - c`` (``get_model_chunk_id(..., forward=False)``).
  The number in flight is the same at every steady step, but the mix moves toward the first chunks:
  where the chunks' activations differ (MoE and dense layers, the head's chunk) the rank's peak is
  the heaviest of these states, not the first.
"""

from __future__ import annotations

from collections import Counter


def warmup(pp: int, rank: int, chunks: int, microbatches: int, group: int | None = None) -> int:
    """megatron's ``get_pp_rank_microbatches`` warm-up count (training)."""
    total = microbatches * chunks
    if pp == 1:
        return 0
    if chunks == 1:
        count = pp - rank - 1
    else:
        count = (pp - rank - 1) * 2 + (chunks - 1) * (group or pp)
    return min(count, total)


def schedule_table(microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """megatron's ``get_schedule_table``: (microbatch, model chunk) of each forward, in order."""
    table = []
    for start in range(0, microbatches, group):
        end = microbatches if start + group >= microbatches else start + group
        table += [(mb, chunk) for chunk in range(chunks) for mb in range(start, end)]
    return table


def in_flight_states(pp: int, rank: int, chunks: int, microbatches: int, group: int | None = None) -> list[Counter]:
    """The chunk counts held after each forward of the interleaved schedule's warm-up end and steady
    phase (before that forward's paired backward), in order."""
    table = schedule_table(microbatches, chunks, group or pp)
    total = len(table)
    first = min(warmup(pp, rank, chunks, microbatches, group) + 1, total)
    held = Counter(chunk for _, chunk in table[:first])
    states = [Counter(held)]
    for k in range(total - first):
        held[chunks - 1 - table[k][1]] -= 1  # the k-th backward
        held[table[first + k][1]] += 1  # the next forward
        states.append(Counter(held))
    return states


def in_flight_chunks(
    pp: int,
    rank: int,
    chunks: int,
    microbatches: int,
    group: int | None = None,
    chunk_bytes: list[int] | None = None,
) -> dict[int, int]:
    """model chunk -> microbatches of it whose activations are held at the rank's peak: the
    heaviest state by ``chunk_bytes`` (one microbatch's activations of each chunk), the first
    (the warm-up's end) where they are not given or alike."""
    if pp == 1:
        return {0: 1}
    if chunks == 1:
        return {0: min(pp - rank, microbatches)}
    states = in_flight_states(pp, rank, chunks, microbatches, group)
    weights = chunk_bytes or [1] * chunks
    worst = max(states, key=lambda held: sum(weights[c] * n for c, n in held.items()))  # first of equals
    return {c: worst.get(c, 0) for c in range(chunks)}


def last_forward_chunk(pp: int, chunks: int, microbatches: int, group: int | None = None) -> int:
    """The model chunk of a rank's last forward in a step (what compare's activation probe keeps)."""
    if chunks == 1:
        return 0
    return schedule_table(microbatches, chunks, group or pp)[-1][1]
