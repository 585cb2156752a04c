"""Fix: Megatron-FSDP reduces the gradients twice under ``optim`` without ``overlap_grad_reduce``.

Without ``overlap_grad_reduce`` (Megatron-LM's default; megatron-core's ``DistributedDataParallelConfig``
default) the ``no_shard`` and ``optim`` strategies reduce the gradients once, synchronously, in
``finish_grad_sync`` (``MegatronFSDP.synchronize_gradient_reduce`` -> ``start_grad_sync``:
``reduce_scatter_gradients`` / ``all_reduce_gradients``, each scaling by 1/DP first). But the backward hooks
(``_process_post_backward_gradients``, ``_root_post_backward``) also launch the ``GradReducePipeline``'s
reduce-scatter of every bucket whenever ``is_last_microbatch`` or ``model_auto_sync`` is set, whatever
``overlap_grad_reduce`` says. ``is_last_microbatch`` is set by ``MegatronFSDP.no_sync()`` on exit, and
megatron's schedules enter ``config.no_sync_func`` before every last microbatch, so a megatron-core script
that sets ``config.no_sync_func = model.no_sync`` (as it does for ``DistributedDataParallel``, where that is
harmless without overlap) has its gradients reduced by the hooks and then again by ``finish_grad_sync``:
scaled by 1/DP twice. Megatron-LM's ``train`` sets ``no_sync_func`` only under ``--overlap-grad-reduce``,
so its command line does not reach it; ``MegatronFSDP.sync()`` / ``set_model_auto_sync(True)`` do, with or
without ``no_sync``. On every device (the code is device-independent). Measured on gloo ranks (the tiny GPT
of ``/tmp``'s user script: 2 layers, hidden 64, megatron's ``get_forward_backward_func``, ``finalize_model_grads``,
``get_megatron_optimizer``): DP 2, grad norm 0.391085 against the distributed optimizer's 0.782171 (half),
DP 4 0.138033 against 0.552131 (a quarter), megatron-core 0.16.1; 0.19.2 at DP 2 0.617055 against 0.782171;
losses apart from step 2 (Adam is nearly scale-free; with SGD or a clip threshold the steps shrink by DP).
The same script without ``no_sync_func``, or with ``overlap_grad_reduce``, equals the distributed optimizer
to the printed digit.

The fix: without ``overlap_grad_reduce`` the pipeline's ``reduce_gradients`` reduces nothing, so the
gradients are reduced where megatron documents it for that mode, once, in ``finish_grad_sync`` (what
Megatron-LM's runs and megatron's own tests, which set no ``no_sync_func``, do). ``optim_grads`` and
``optim_grads_params`` are untouched: megatron forces ``overlap_grad_reduce`` on for them.
"""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-megatron-fsdp-sync-grad-reduce"
VERSIONS = ">=0.16"
"""Run on 0.16.1 and 0.19.2; 0.17.1 and 0.18.2 read (the same hooks and ``start_grad_sync``). 0.14/0.15's
Megatron-FSDP does not build with torch 2.13 and 0.13 has none (custom_fsdp): not read."""
TARGET = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer.GradReducePipeline.reduce_gradients"


def reduce_only_when_overlapping(wrapped, instance, args, kwargs):
    ddp_config = getattr(getattr(instance, "buffer", None), "ddp_config", None)
    if ddp_config is not None and not ddp_config.overlap_grad_reduce:
        return None  # finish_grad_sync reduces every bucket, synchronously
    return wrapped(*args, **kwargs)


PATCHES = [
    Patch(
        TARGET,
        Kind.WRAP,
        reduce_only_when_overlapping,
        versions=VERSIONS,
        why="without overlap_grad_reduce the backward hooks reduce the gradients (after no_sync or under "
        "model_auto_sync) and finish_grad_sync reduces them again: averaged twice",
    )
]

FEATURE = Feature(
    name=NAME,
    summary="Megatron-FSDP optim / no_shard without --overlap-grad-reduce reduces the gradients once (with megatron's "
    "schedule's no_sync_func set, or model_auto_sync, they were reduced twice: gradients and grad norm 1/DP too small)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
