"""Fix: with several distributed-optimizer instances, a later pipeline stage reduced its gradients twice.

megatron-core 0.16-0.19's ``_ParamAndGradBucketGroup`` (``--overlap-grad-reduce`` with
``--num-distributed-optimizer-instances N > 1``) runs its collectives synchronously on a
communication stream, so ``grad_reduce_handle`` stays None. Its guard against a second
``start_grad_sync`` in one step, ``if self.is_first_batch and self.grad_reduce_handle is not None:
return``, reads that handle, and so never holds with several instances.

Under pipeline parallelism with ``align_grad_reduce`` (Megatron-LM's default), every stage but the
first runs its last backward inside ``no_sync`` and then calls ``config.grad_sync_func``
(``model.start_grad_sync``: the reduce-scatter within the instance, then the all-reduce across
instances); ``finalize_model_grads`` then calls ``finish_grad_sync``, which starts the reduction again
while ``is_first_batch`` holds. On those stages ``is_first_batch`` never clears: it clears in
``reset()`` only once a last-microbatch backward registered gradients as ready, and theirs ran
under ``no_sync``. So every step reduce-scattered already-reduced shards a second time (each rank's
own stale copies of the other shards summed in) and scaled them twice: measured with Megatron-LM's
pretrain_gpt.py at PP 2 x DP 4, 2 instances, grad norm 1.133 where one instance prints 1.307.
One instance is unaffected (its asynchronous handle makes the guard hold), and so is the first stage.

The fix is megatron's own guard, made to hold with several instances: a bucket group that already
started its reduction since the last ``finish_grad_sync`` does not start it again in the first-batch
path. Every device (Python logic); megatron-core 0.13-0.15 have no ``is_first_batch`` and are left alone.
"""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-distopt-instances-grad-sync"
GROUP = "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup"
STARTED = "_mindspeed_like_reduction_started"


def _synchronous_instances(group) -> bool:
    config = group.ddp_config
    return bool(config.overlap_grad_reduce) and getattr(config, "num_distributed_optimizer_instances", 1) > 1


def start_once_per_step(wrapped, instance, args, kwargs):
    if not hasattr(instance, "is_first_batch") or not _synchronous_instances(instance):
        return wrapped(*args, **kwargs)
    if instance.is_first_batch and getattr(instance, STARTED, False):
        return None  # megatron's "collective already dispatched" no-op, for the synchronous path
    result = wrapped(*args, **kwargs)
    setattr(instance, STARTED, True)
    return result


def finish_ends_the_step(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    finally:
        setattr(instance, STARTED, False)


PATCHES = [
    Patch(
        f"{GROUP}.start_grad_sync",
        Kind.WRAP,
        start_once_per_step,
        why="with several distributed-optimizer instances, finish_grad_sync's first-batch path started a later "
        "pipeline stage's reduction a second time (its guard reads an async handle the instances path never sets)",
        after=("cpu-adapter",),  # decides before the host's stream switch runs
    ),
    Patch(
        f"{GROUP}.finish_grad_sync",
        Kind.WRAP,
        finish_ends_the_step,
        why="the next step's reduction may start again once this step's is finished",
        after=("cpu-adapter",),
    ),
]

FEATURE = Feature(
    name=NAME,
    summary="--num-distributed-optimizer-instances N>1 with --overlap-grad-reduce under pipeline parallelism: later "
    "stages reduce their gradients once per step (were reduced twice: wrong gradients every step)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
