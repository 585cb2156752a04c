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


def test_the_steady_phase_moves_the_mix_toward_the_first_chunks() -> None:
    """Interleaved, PP 2, V 2, 16 microbatches, rank 0: 5 in flight at the warm-up's end ({0: 3, 1: 2}),
    then each backward (chunk V - 1 - c of the k-th table entry) and forward keep 5 but reach {0: 4, 1: 1};
    the heaviest state by the chunks' bytes is the rank's peak."""
    states = schedule.in_flight_states(2, 0, 2, 16)
    assert states[0] == {0: 3, 1: 2} and {0: 4, 1: 1} in states
    assert all(sum(state.values()) == 5 for state in states)
    assert schedule.in_flight_chunks(2, 0, 2, 16) == {0: 3, 1: 2}  # alike chunks: the first state
    assert schedule.in_flight_chunks(2, 0, 2, 16, chunk_bytes=[3, 1]) == {0: 4, 1: 1}
    assert schedule.in_flight_chunks(2, 0, 2, 16, chunk_bytes=[1, 3]) == {0: 3, 1: 2}


def test_a_microbatch_group_other_than_pp_is_planned_and_checked(capsys) -> None:
    """--microbatch-group-size-per-virtual-pipeline-stage G: megatron needs PP <= G <= M and M % G either
    0 or at least PP (schedules.py), not M a multiple of PP; the warm-up grows by (V - 1) x G."""
    import json

    from mindspeed_like.plan import cli

    command = (
        "--num-layers 12 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
        "--micro-batch-size 1 --vocab-size 1000 --tokenizer-type NullTokenizer --bf16 --pipeline-model-parallel-size 3 "
        "--num-virtual-stages-per-pipeline-rank 2 --microbatch-group-size-per-virtual-pipeline-stage 4 --world-size 3 "
        "--parser builtin"
    ).split()
    assert cli.main([*command, "--global-batch-size", "16", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["per_rank"]
    assert sum(stages[0]["microbatches_in_flight"].values()) == (3 - 1) * 2 + (2 - 1) * 4 + 1
    assert cli.main([*command, "--global-batch-size", "6"]) == 2
    assert "or to leave at least PP (3) over" in capsys.readouterr().err
    assert cli.main([*command, "--global-batch-size", "3"]) == 2
    assert "between PP (3) and the microbatches per step (3)" in capsys.readouterr().err
