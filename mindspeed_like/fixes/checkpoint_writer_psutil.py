"""Fix: a distributed-checkpoint save without psutil hangs forever instead of failing.

megatron's async filesystem writer (``dist_checkpointing`` torch_dist format) measures its
memory with psutil inside the forked writer process (``filesystem_async._process_memory``).
Without psutil that child raises, and the parent waits for its results forever: measured here,
a save that never returns (any device; megatron-core 0.13-0.16 import psutil optionally and
only fail at that point). The writer is constructed in the saving process before anything is
forked, so ``FileSystemWriterAsync.__init__`` is where the missing package can be reported
while the caller can still handle it.
"""

from __future__ import annotations

import sys

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import CHECKPOINT_STRATEGIES

WRITER_MODULE = f"{CHECKPOINT_STRATEGIES}.filesystem_async"


class CheckpointDependencyError(RuntimeError):
    """A package megatron's checkpoint writer needs is missing."""


def _require_psutil(wrapped, instance, args, kwargs):
    if not getattr(sys.modules[WRITER_MODULE], "HAVE_PSUTIL", True):
        raise CheckpointDependencyError(
            "megatron's distributed checkpoint writer needs psutil (pip install psutil): without it the "
            "writer process fails and the save would wait forever (mindspeed_like stops it here)"
        )
    return wrapped(*args, **kwargs)


PATCHES = [
    Patch(
        f"{WRITER_MODULE}.FileSystemWriterAsync.__init__",
        Kind.WRAP,
        _require_psutil,
        why="fail at construction when psutil is missing instead of hanging in the forked writer",
    )
]

FEATURE = Feature(
    name="fix-checkpoint-writer-needs-psutil",
    summary="a distributed-checkpoint save without psutil fails with a clear error instead of hanging",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
