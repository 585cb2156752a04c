"""Fix: Megatron-FSDP with ``--data-parallel-sharding-strategy no_shard`` cannot take a step.

After each optimizer step the distributed optimizer calls ``MegatronFSDP.start_param_sync``, which
all-gathers every bucket's sharded weights. With ``no_shard`` the weights are not sharded and no
bucket has a weight buffer; megatron-core 0.14-0.16 gather first and check afterwards:
``AttributeError: 'NoneType' object has no attribute 'fetch_bucket'`` at the first step, on every
device. megatron-core 0.19 returns at once for ``no_shard`` (nothing to gather: every rank holds the
whole updated weights); this is that return, for the releases without it.
"""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-megatron-fsdp-no-shard"
TARGET = "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp.MegatronFSDP.start_param_sync"


def nothing_to_gather_without_shards(wrapped, instance, args, kwargs):
    if getattr(instance, "data_parallel_sharding_strategy", None) == "no_shard":
        return None
    return wrapped(*args, **kwargs)


PATCHES = [
    Patch(
        TARGET,
        Kind.WRAP,
        nothing_to_gather_without_shards,
        versions=">=0.14",
        why="no_shard has no sharded weights to all-gather (megatron-core 0.19's own early return)",
    )
]

FEATURE = Feature(
    name=NAME,
    summary="--use-megatron-fsdp --data-parallel-sharding-strategy no_shard steps (was AttributeError "
    "'fetch_bucket' after the first optimizer step; megatron-core 0.19 returns early itself)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
