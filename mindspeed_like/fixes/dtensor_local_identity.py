"""Fix: checkpoints of megatron's torch-FSDP2 models with torch 2.13 ("Param id 0 does not match").

megatron-core keys a distributed checkpoint's optimizer state by the identity of each parameter's
local shard: ``get_optim_param_to_id_map`` maps ``id(to_local_if_dtensor(param))`` of the optimizer's
parameters, the model's ``sharded_state_dict`` holds ``param._local_tensor`` of the same DTensor
parameters (``make_tp_sharded_tensor_for_checkpoint``), and the two must be the same object.
``megatron.core.utils.to_local_if_dtensor`` returns ``tensor.to_local()`` under ``torch.no_grad()``,
which was ``tensor._local_tensor`` itself until torch 2.13: there ``to_local()`` of a
``Parameter(DTensor)`` returns a fresh view (so that it is an ``nn.Parameter`` too, pytorch
gh-166156). Every save of a ``--use-torch-fsdp2`` model with ``--ckpt-format torch_dist`` then stops
with ``ValueError: Param id 0 does not match any model sharded param``, on every device.

The fix gives megatron what it relied on: for a DTensor, the local tensor itself (what ``to_local()``
under no-grad returned before 2.13, byte for byte the same data); anything else goes to megatron's
function unchanged. Applied only where the installed torch's ``to_local()`` loses the identity.
"""

from __future__ import annotations

import functools

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Context, Feature, always_on

NAME = "fix-dtensor-local-identity"
TARGET = "megatron.core.utils.to_local_if_dtensor"


@functools.cache
def to_local_loses_identity() -> bool:
    """Whether this torch's ``DTensor.to_local()`` of a parameter under no-grad is a new object."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    if not hasattr(DTensor, "to_local"):
        return False

    class Probe:  # the attributes to_local reads, without a device mesh or process group
        _local_tensor = torch.zeros(1)
        _is_param = True

    with torch.no_grad():
        try:
            local = DTensor.to_local(Probe())  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - a torch whose to_local needs more: ask a real DTensor at call time
            return True
    return local is not Probe._local_tensor


def local_tensor_itself(wrapped, instance, args, kwargs):
    from torch.distributed.tensor import DTensor

    tensor = args[0] if args else kwargs.get("tensor")
    if isinstance(tensor, DTensor):
        return tensor._local_tensor
    return wrapped(*args, **kwargs)


def patches(ctx: Context) -> list[Patch]:
    if not to_local_loses_identity():
        return []
    return [
        Patch(
            TARGET,
            Kind.WRAP,
            local_tensor_itself,
            optional=True,
            why="torch 2.13's to_local() of a Parameter(DTensor) is a new view; megatron keys checkpoints by its id",
        )
    ]


FEATURE = Feature(
    name=NAME,
    summary="--use-torch-fsdp2 checkpoints save with torch 2.13 (megatron's optimizer-state map keys by the "
    "identity of each DTensor's local shard, which torch 2.13's to_local() no longer returns)",
    patches=patches,
    enabled=always_on,
    backend="any",
    kind="fix",
)
