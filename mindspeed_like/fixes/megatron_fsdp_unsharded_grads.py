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
- ``optim_grads`` / ``optim_grads_params`` with experts at expert data-parallel size 1 (EP equal to DP, e.g. DP 2 x
  EP 2): the experts' buffer is not distributed, yet its factor is 1/DP (megatron scales expert gradients by the
  whole data-parallel size, as its DDP does), and each backward's reduction pre-scales everything the buffer holds,
  so with two microbatches a step the first one's expert gradients are scaled twice: pretrain_gpt.py DP 2 x EP 2,
  dropout 0.1, micro-batch 1: grad norm 0.889 against the distributed optimizer's 0.892, lm loss apart from
  iteration 2 (5.522417 vs 5.523337); PP 2 x EP 2 on 4 ranks 0.939 against 0.943.
On every device (the logic is Python).

The fix keeps megatron's reduction and what it adds into: for a gradient buffer that is not distributed (and
not ``no_shard``, an all-reduce in place that adds nothing), the reduction's bucket is a copy of the
accumulated gradients taken just before it and the buffer is zeroed, so ``local_grad += reduced_grad`` leaves
the rank's part holding the reduced gradients once. The copy and the zeroing run on the current stream before
the reduction, which waits for that stream first (``reduce_scatter_stream.wait_stream(current_stream)``); the
copy is kept alive for the reduce-scatter stream (``record_stream``, untested on a GPU). The rest of an
undistributed buffer, which the optimizer of a sharded strategy never reads (it takes its shard), reads zero
afterwards instead of this rank's unreduced gradients. Where such a buffer is reduced after every backward and its
factor multiplies (not 1, not ``average_in_collective``), its reductions run without the factor (megatron's
reduction then sums: on its one rank, the gradients themselves), and the factor is applied once, after
``MegatronFSDP.synchronize_gradient_reduce`` has waited for the step's reductions (``finish_grad_sync`` calls it
before handing the gradients to the optimizer): the distributed optimizer's ``factor * (g1 + g2)``.

megatron-core 0.17.0 fixed both itself (a reduction into an unsharded buffer writes the shard in place and adds
nothing: ``grad_accum_closure``; the same in 0.18.0 and 0.19.2), hence ``<0.17``: there this wrapper's zeroing
would lose the gradients. 0.14.0 and 0.15.0 (Megatron-LM's core_v0.14.0 / core_v0.15.0 tags) have 0.16.1's
lines and names unchanged (read, not run). 0.13's ``custom_fsdp`` has the same addition for ``optim`` with
overlap (``local_buffer += grad_shards[bucket_id]``, read, not run) and is left alone: 0.13's FSDP is not a
path this library adapts.
"""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.fixes.megatron_fsdp_hsdp_grad_reduce import DELAYED
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-megatron-fsdp-unsharded-grads"
VERSIONS = ">=0.14,<0.17"
MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
TARGET = f"{MODULE}.GradReducePipeline._bucket_group_gradient_reduce"
SYNC = "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp.MegatronFSDP.synchronize_gradient_reduce"


def _adds_to_itself(pipeline, gbuf) -> bool:
    """The buffer megatron hands the reduction as its own bucket and then adds the result back into."""
    return not gbuf.is_data_distributed and pipeline.buffer.ddp_config.data_parallel_sharding_strategy != "no_shard"


def _scaled_again_each_backward(pipeline, gbuf) -> bool:
    """An undistributed buffer of a strategy that reduces after every backward (so its group is one rank)
    whose reduction multiplies: each reduction would scale again what the earlier ones already scaled."""
    config = pipeline.buffer.ddp_config
    factor = gbuf.gradient_scaling_factor
    return (
        config.data_parallel_sharding_strategy not in DELAYED
        and not config.average_in_collective
        and factor is not None
        and factor != 1.0
    )


def reduce_a_copy_of_unsharded_grads(wrapped, instance, args, kwargs):
    bucket_group = kwargs["bucket_group"] if "bucket_group" in kwargs else args[0]
    gbufs = [instance.get_fsdp_buffer(bucket_id) for bucket_id in bucket_group]
    swapped = [gbuf for gbuf in gbufs if _adds_to_itself(instance, gbuf)]
    if not swapped:
        return wrapped(*args, **kwargs)
    unscaled = [gbuf for gbuf in swapped if _scaled_again_each_backward(instance, gbuf)]
    pending = instance.__dict__.setdefault("_unscaled_grad_buffers", {})
    for gbuf in unscaled:  # summed unscaled over the microbatches, scaled once at the step's end
        pending[id(gbuf)] = (gbuf, gbuf.gradient_scaling_factor)
        gbuf.gradient_scaling_factor = None  # megatron's reduction then sums (one rank: the gradient itself)
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
        for gbuf in unscaled:
            gbuf.gradient_scaling_factor = pending[id(gbuf)][1]


def scale_once_after_the_reductions(wrapped, instance, args, kwargs):
    """After megatron's wait for the step's reductions: the buffers summed unscaled get their scaling factor
    once, as megatron's DDP scales the accumulated gradients once."""
    result = wrapped(*args, **kwargs)
    pipeline = getattr(instance, "grad_reduce_pipeline", None)
    pending = pipeline.__dict__.pop("_unscaled_grad_buffers", {}) if pipeline is not None else {}
    for gbuf, factor in pending.values():
        gbuf.get_shard_from_local_buffer().mul_(factor)
    return result


PATCHES = [
    Patch(
        TARGET,
        Kind.WRAP,
        reduce_a_copy_of_unsharded_grads,
        versions=VERSIONS,
        after=("cpu-adapter",),
        why="an undistributed gradient buffer (optim with overlap; gradient sharding at DP 1) gets the reduced "
        "shard added to its unreduced gradients",
    ),
    Patch(
        SYNC,
        Kind.WRAP,
        scale_once_after_the_reductions,
        versions=VERSIONS,
        why="an undistributed buffer reduced after every backward (experts at expert-DP 1) is scaled once a "
        "step, not again at each microbatch",
    ),
]

FEATURE = Feature(
    name=NAME,
    summary="--use-megatron-fsdp reduces gradients kept in an unsharded buffer once (optim with "
    "--overlap-grad-reduce at any DP size, gradient sharding at DP 1: megatron added the reduced shard to the "
    "rank's own unreduced gradients; experts at expert-DP 1 were scaled again at each microbatch)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
