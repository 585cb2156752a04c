"""The patching engine: knows neither kernels nor megatron; applies, stacks and undoes patches."""

from mindspeed_like.engine.engine import PatchEngine, distribution_version, wrappers_of
from mindspeed_like.engine.locate import split_target
from mindspeed_like.engine.patch import (
    Deferred,
    Kind,
    Patch,
    PatchError,
    PatchRecord,
    PatchTargetError,
    StackingError,
    pass_through,
)

__all__ = [
    "Deferred",
    "Kind",
    "Patch",
    "PatchEngine",
    "PatchError",
    "PatchRecord",
    "PatchTargetError",
    "StackingError",
    "distribution_version",
    "pass_through",
    "split_target",
    "wrappers_of",
]
