"""Fix: Megatron-FSDP adds the reduced gradient shard to the unreduced gradients it came from.

With ``--use-megatron-fsdp`` megatron-core 0.14-0.16's ``GradReducePipeline._bucket_group_gradient_reduce``
(``param_and_grad_buffer.py``, the path the gradient hooks take under ``--overlap-grad-reduce``, which
``optim_grads`` / ``optim_grads_params`` always switch on) reduce-scatters the bucket ``fetch_bucket`` hands it
into a new shard and then adds that shard into the rank's part of the main gradient buffer
(``local_grad += reduced_grad``). Where that buffer is distributed (gradient sharding over more than one rank),
the bucket is a separate unsharded buffer and the rank's shard was empty, so the addition is right. Where it is
not distributed, the bucket *is* the main gradient buffer, whose rank part still holds the rank's own
(pre-scaled) gradients, so they are added to the reduced ones:
- ``optim`` with ``--overlap-grad-reduce`` at any data-parallel size (megatron's buffer for ``optim`` keeps whole
  gradients; its reduction without overlap, ``reduce_scatter_gradients``, writes the shard in place and is
  right). Megatron-LM core_v0.16.1 ``pretrain_gpt.py``, 2 gloo ranks (DP 2), dropout 0.1: grad norm 1.841 /
  2.338 / 2.168 against the distributed optimizer's 1.183 / 1.583 / 1.494, lm loss apart from iteration 2
  (5.518137 vs 5.520185); ``optim`` without overlap printed the distributed optimizer's digits.
- ``optim_grads`` / ``optim_grads_params`` at data-parallel size 1 (e.g. TP 2 on 2 ranks, with or without PP):
  megatron distributes the buffer only over more than one rank (``is_data_distributed=is_grad_buffer_distributed
  and main_buf_dp_group.size() > 1``) and the reduction runs after every microbatch, so everything accumulated
  doubled each time: TP 2 on 2 ranks, one microbatch a step, grad norm 3.033 against 1.517; four, 15.897
  against 1.502.
On every device (the logic is Python).

The fix keeps megatron's reduction and what it adds into: for a gradient buffer that is not distributed (and
not ``no_shard``, an all-reduce in place that adds nothing), the reduction's bucket is a copy of the
accumulated gradients taken just before it and the buffer is zeroed, so ``local_grad += reduced_grad`` leaves
the rank's part holding the reduced gradients once. The copy and the zeroing run on the current stream before
the reduction, which waits for that stream first (``reduce_scatter_stream.wait_stream(current_stream)``); the
copy is kept alive for the reduce-scatter stream (``record_stream``, untested on a GPU). The rest of an
undistributed buffer, which the optimizer of a sharded strategy never reads (it takes its shard), reads zero
afterwards instead of this rank's unreduced gradients.

megatron-core 0.17.0 fixed both itself (a reduction into an unsharded buffer writes the shard in place and adds
nothing: ``grad_accum_closure``; the same in 0.18.0 and 0.19.2), hence ``<0.17``: there this wrapper's zeroing
would lose the gradients. 0.14.0 and 0.15.0 (Megatron-LM's core_v0.14.0 / core_v0.15.0 tags) have 0.16.1's
lines and names unchanged (read, not run). 0.13's ``custom_fsdp`` has the same addition for ``optim`` with
overlap (``local_buffer += grad_shards[bucket_id]``, read, not run) and is left alone: 0.13's FSDP is not a
path this library adapts.
"""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-megatron-fsdp-unsharded-grads"
VERSIONS = ">=0.14,<0.17"
MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
TARGET = f"{MODULE}.GradReducePipeline._bucket_group_gradient_reduce"


def _adds_to_itself(pipeline, gbuf) -> bool:
    """The buffer megatron hands the reduction as its own bucket and then adds the result back into."""
    return not gbuf.is_data_distributed and pipeline.buffer.ddp_config.data_parallel_sharding_strategy != "no_shard"


def reduce_a_copy_of_unsharded_grads(wrapped, instance, args, kwargs):
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
        reduce_a_copy_of_unsharded_grads,
        versions=VERSIONS,
        after=("cpu-adapter",),
        why="an undistributed gradient buffer (optim with overlap; gradient sharding at DP 1) gets the reduced "
        "shard added to its unreduced gradients",
    )
]

FEATURE = Feature(
    name=NAME,
    summary="--use-megatron-fsdp reduces gradients kept in an unsharded buffer once (optim with "
    "--overlap-grad-reduce at any DP size, gradient sharding at DP 1: megatron added the reduced shard to the "
    "rank's own unreduced gradients)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
