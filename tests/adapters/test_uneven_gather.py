"""cpu-adapter: megatron's all-gather of uneven pieces (``output_split_sizes``) on gloo.

The alltoall token dispatcher with expert tensor parallelism > 1 gathers each expert-TP rank's routed
tokens with ``_gather_along_first_dim(..., output_split_sizes=...)``, a ``torch.distributed.all_gather``
of a list of uneven tensors: NCCL takes it, gloo refuses it. Megatron-LM's pretrain_gpt.py with MoE at
TP 2 x CP 2 x EP 2 on 4 gloo ranks stopped at the first forward with and without FSDP ("ProcessGroupGloo::
allgather: invalid tensor size at index 0 (expected (64, 64), got (60, 64))"); it trains now
(tests/fsdp/test_fsdp_parallel_layouts.py, ``megatron-fsdp-tp2-cp2-ep2``).
"""

from __future__ import annotations

import uneven_gather_workers as workers

from mindspeed_like.testing import run_distributed


def test_uneven_pieces_are_gathered_in_rank_order_and_their_gradient_reduce_scattered():
    for result in run_distributed(workers.gather_uneven, 2, True, timeout=300):
        assert result["gathered"] == result["expected"]
        start = sum(result["sizes"][: result["rank"]])
        rows = result["weights"][start : start + result["sizes"][result["rank"]]]
        assert result["grad"] == [
            [2 * x for x in row] for row in rows
        ]  # both ranks' weights, summed by the reduce-scatter


def test_megatrons_host_twin_alone_is_refused_by_gloo():
    """What ran before (the plain host twin): gloo's error, on each rank."""
    for result in run_distributed(workers.gather_uneven, 2, False, timeout=300):
        assert "ProcessGroupGloo::allgather: invalid tensor size" in (result["error"] or "")
