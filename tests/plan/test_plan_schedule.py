"""Microbatches in flight per pipeline rank: the plan's arithmetic against megatron's own schedule
functions (``get_pp_rank_microbatches``, ``get_schedule_table``), called with a stand-in for the
p2p communicator (its pipeline group's size and rank)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mindspeed_like.plan import schedule


def _megatron_warmup(pp: int, rank: int, chunks: int, microbatches: int) -> int:
    """megatron's own count: from 0.14 it reads the pipeline group from a p2p communicator argument,
    before that from parallel_state (its getters stood in for here)."""
    import inspect
    from unittest import mock

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules

    function = schedules.get_pp_rank_microbatches
    if "p2p_communicator" in inspect.signature(function).parameters:
        group = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
        p2p = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None)
        return function(microbatches, chunks, pp, p2p_communicator=p2p)[2]
    virtual = chunks if chunks > 1 else None
    with (
        mock.patch.object(parallel_state, "get_pipeline_model_parallel_world_size", lambda *a, **k: pp),
        mock.patch.object(parallel_state, "get_pipeline_model_parallel_rank", lambda *a, **k: rank),
        mock.patch.object(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda *a, **k: virtual),
    ):
        return function(microbatches, chunks, pp)[2]


@pytest.mark.parametrize(
    ("pp", "chunks", "microbatches"), [(2, 1, 2), (4, 1, 8), (4, 1, 2), (2, 2, 2), (4, 2, 8), (4, 3, 4)]
)
def test_warmup_and_schedule_table_are_megatrons(pp: int, chunks: int, microbatches: int) -> None:
    from megatron.core.pipeline_parallel import schedules

    for rank in range(pp):
        assert schedule.warmup(pp, rank, chunks, microbatches) == _megatron_warmup(pp, rank, chunks, microbatches)
    assert schedule.schedule_table(microbatches, chunks, pp) == schedules.get_schedule_table(microbatches, chunks, pp)


def test_in_flight_counts() -> None:
    # 1F1B: PP - stage, at most the microbatches of the step
    assert [schedule.in_flight_chunks(4, r, 1, 8)[0] for r in range(4)] == [4, 3, 2, 1]
    assert [schedule.in_flight_chunks(4, r, 1, 2)[0] for r in range(4)] == [2, 2, 2, 1]
    # interleaved PP 2 x 2 chunks, 2 microbatches: rank 0 runs every forward before a backward
    assert schedule.in_flight_chunks(2, 0, 2, 2) == {0: 2, 1: 2}
    assert schedule.in_flight_chunks(2, 1, 2, 2) == {0: 2, 1: 1}
    assert schedule.last_forward_chunk(2, 2, 2) == 1
    assert schedule.in_flight_chunks(1, 0, 1, 16) == {0: 1}
