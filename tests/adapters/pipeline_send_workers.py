"""Spawned gloo processes for test_pipeline_sends.py (importable by the children)."""

from __future__ import annotations

import time

import torch

ELEMENTS = 16384  # 64 KiB of fp32: a stage output the host allocator hands out again once freed
TRIALS = 10


def overlapped_sends_after_the_output_is_freed(with_patch: bool) -> int:
    """Rank 0 sends a stage output through megatron's ``_p2p_ops`` (the interleaved schedule's overlapped
    send) and frees it as the schedule does (``deallocate_output_tensor``) before waiting; rank 1 posts its
    receive afterwards. Returns, on rank 1, how many of the trials received other numbers than were sent;
    ``with_patch`` False: megatron's ``_p2p_ops`` itself (the patch's ``__wrapped__``)."""
    import mindspeed_like

    mindspeed_like.configure(device="cpu")
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    p2p_ops = p2p_communication._p2p_ops if with_patch else p2p_communication._p2p_ops.__wrapped__
    assert hasattr(p2p_communication._p2p_ops, "__wrapped__"), "the cpu adapter's patch is applied"
    group, rank = torch.distributed.group.WORLD, torch.distributed.get_rank()
    nothing = dict(tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=None, tensor_recv_next=None)
    wrong = 0
    for trial in range(TRIALS):
        if rank == 0:
            output = torch.full((ELEMENTS,), float(trial + 1))
            requests = p2p_ops(
                **{**nothing, "tensor_send_next": output}, group=group, prev_pipeline_rank=1, next_pipeline_rank=1
            )
            schedules.deallocate_output_tensor(output, deallocate_pipeline_outputs=True)
            later = [torch.full((ELEMENTS,), -7.0) for _ in range(8)]  # the next microbatch's tensors
            time.sleep(0.05)
            for request in requests.values():
                request.wait()
            del later
        else:
            time.sleep(0.02)  # the receiving stage is still computing
            received = torch.empty(ELEMENTS)
            requests = p2p_ops(
                **{**nothing, "tensor_recv_prev": received}, group=group, prev_pipeline_rank=0, next_pipeline_rank=0
            )
            for request in requests.values():
                request.wait()
            wrong += int(not torch.equal(received, torch.full((ELEMENTS,), float(trial + 1))))
        torch.distributed.barrier()
    return wrong
