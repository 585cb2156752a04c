"""Fix: Megatron-FSDP at data-parallel size 1 adds each microbatch's gradients to themselves.

With ``--use-megatron-fsdp`` and gradient sharding (``optim_grads``, ``optim_grads_params``) megatron-core
0.16.1 distributes the main gradient buffer only over more than one rank
(``param_and_grad_buffer.py``: ``is_data_distributed=is_grad_buffer_distributed and main_buf_dp_group.size()
> 1``). At DP 1 (e.g. TP 2 on 2 ranks, with or without PP) the backward therefore accumulates straight into
the main gradient buffer, ``fetch_bucket`` hands ``GradReducePipeline._bucket_group_gradient_reduce`` that
buffer itself, and after the 1-rank reduce-scatter (a copy) the reduced shard is added back into the same
buffer (``local_grad += reduced_grad``): everything accumulated so far is doubled after every microbatch,
on every device (the logic is Python). Measured with Megatron-LM core_v0.16.1's pretrain_gpt.py, TP 2 on 2
gloo ranks: one microbatch a step, grad norm 3.033 against the distributed optimizer's 1.517; four, 15.897
against 1.502, and the lm loss differs from iteration 2. ``optim`` with ``--overlap-grad-reduce`` takes the
same path on the last microbatch.

The fix keeps megatron's reduction and fixes what it accumulates into, as at DP > 1: for a gradient buffer
that is not distributed and whose group is one rank, the reduction's bucket is a copy of the accumulated
gradients taken just before it, and the buffer is zeroed, so ``local_grad += reduced_grad`` leaves the
buffer holding the (scaled) gradients once. The copy and the zeroing run on the current stream before the
reduction, which waits for that stream first (``reduce_scatter_stream.wait_stream(current_stream)``); the
copy is kept alive for the reduce-scatter stream (``record_stream``). Nothing changes where the group has
more than one rank (there gradient sharding distributes the buffer; ``optim`` at DP > 1, undistributed, was
not examined here) or with ``no_shard`` (an all-reduce in place, nothing added).

megatron-core 0.17.0 fixed this itself (the reduce-scatter writes into the unsharded buffer and nothing is
added to it: ``grad_accum_closure``; the same in 0.18.0 and 0.19.2), hence ``<0.17``: there this wrapper's
zeroing would lose the gradients. 0.14.0 and 0.15.0 (Megatron-LM's core_v0.14.0 / core_v0.15.0 tags) have
0.16.1's lines and names unchanged (read, not run); 0.13 has ``custom_fsdp``, which distributes at DP 1.
"""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-megatron-fsdp-dp1-grads"
VERSIONS = ">=0.14,<0.17"
MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
TARGET = f"{MODULE}.GradReducePipeline._bucket_group_gradient_reduce"


def _adds_to_itself(pipeline, gbuf) -> bool:
    """The buffer megatron hands the reduction as its own bucket and then adds the result back into."""
    return (
        not gbuf.is_data_distributed
        and pipeline.buffer.ddp_config.data_parallel_sharding_strategy != "no_shard"
        and gbuf.data_parallel_group.size() == 1
    )


def reduce_a_copy_at_dp1(wrapped, instance, args, kwargs):
    bucket_group = kwargs["bucket_group"] if "bucket_group" in kwargs else args[0]
    gbufs = [instance.get_fsdp_buffer(bucket_id) for bucket_id in bucket_group]
    swapped = [gbuf for gbuf in gbufs if _adds_to_itself(instance, gbuf)]
    if not swapped:
        return wrapped(*args, **kwargs)
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import Bucket

    stream = getattr(instance, "rs_stream", None)
    for gbuf in swapped:
        own = gbuf.fetch_bucket()  # the buffer's own slice: what the backward accumulated into
        copy = own.data.clone()
        own.data.zero_()
        if copy.is_cuda and stream is not None:
            copy.record_stream(stream)
        gbuf.fetch_bucket = lambda dtype=None, set_param_data=False, _copy=copy: Bucket(data=_copy)
    try:
        return wrapped(*args, **kwargs)
    finally:
        for gbuf in swapped:
            del gbuf.fetch_bucket  # the instance attribute; the class's method again


PATCHES = [
    Patch(
        TARGET,
        Kind.WRAP,
        reduce_a_copy_at_dp1,
        versions=VERSIONS,
        after=("cpu-adapter",),
        why="at DP 1 the gradient buffer is not distributed and the reduced shard is added back into itself",
    )
]

FEATURE = Feature(
    name=NAME,
    summary="--use-megatron-fsdp at data-parallel size 1 reduces each microbatch's gradients once (megatron "
    "added the 1-rank reduce-scatter's copy back into the unsharded gradient buffer: doubled every microbatch)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
