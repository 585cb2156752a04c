"""Fix: megatron's torch-FSDP2 wrapper cannot finish a step (``force_all_reduce`` TypeError).

``finalize_model_grads`` (every training step of megatron's schedules) calls
``model_chunk.finish_grad_sync(force_all_reduce=...)``. ``DistributedDataParallel`` and
Megatron-FSDP take that argument; ``TorchFullyShardedDataParallel`` (``--use-torch-fsdp2``) inherits
``_BaseDataParallel.finish_grad_sync(self)``, which takes none: ``TypeError: ... got an unexpected
keyword argument 'force_all_reduce'`` at the first step, on every device (megatron-core 0.16.1).

The base method is a no-op (torch's FSDP2 reduce-scatters each unit's gradients in its own
backward hooks, so there is nothing left to finish or to all-reduce instead), so the fix accepts the
argument where the installed base method does not and calls it without: exactly what a signature
with ``force_all_reduce=False`` would do. Where megatron's own base method takes it, nothing changes.
"""

from __future__ import annotations

import inspect

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-fsdp2-finish-grad-sync"
TARGET = "megatron.core.distributed.data_parallel_base._BaseDataParallel.finish_grad_sync"


def _takes(function, name: str) -> bool:
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def accept_force_all_reduce(wrapped, instance, args, kwargs):
    if "force_all_reduce" in kwargs and not _takes(wrapped, "force_all_reduce"):
        kwargs = {k: v for k, v in kwargs.items() if k != "force_all_reduce"}
    return wrapped(*args, **kwargs)


PATCHES = [
    Patch(
        TARGET,
        Kind.WRAP,
        accept_force_all_reduce,
        why="finalize_model_grads passes force_all_reduce=, which the base class (torch FSDP2's) does not take",
    )
]

FEATURE = Feature(
    name=NAME,
    summary="--use-torch-fsdp2 trains: finalize_model_grads' finish_grad_sync(force_all_reduce=) accepted by "
    "the FSDP2 wrapper's no-op base method (was TypeError at the first step)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
