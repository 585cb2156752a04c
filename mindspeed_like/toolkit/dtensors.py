"""torch's DTensor, asked about without assuming this torch has it: the parameters of torch FSDP2 and
Megatron-FSDP are DTensors, and features, fixes and meters that meet them read them through here."""

from __future__ import annotations

from typing import Any

import torch


def dtensor_type() -> type | None:
    """``torch.distributed.tensor.DTensor``, or None on a torch without it."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (a sharded parameter or state of FSDP)."""
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(value, dtensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the bytes this rank holds); any other tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
