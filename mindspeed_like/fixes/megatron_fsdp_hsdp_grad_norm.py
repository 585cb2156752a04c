"""Fix: Megatron-FSDP's HSDP with outer-DP sharding counts a fraction of the gradient in its norm.

``get_megatron_optimizer`` gives every distributed optimizer the group of its own instance
(``intra_dist_opt_group``) for the grad norm and the zero count: with
``--num-distributed-optimizer-instances N`` the distributed optimizer's instances each hold the
whole (all-reduced) gradient, so summing within one instance is right. Megatron-FSDP's
``--outer-dp-sharding-strategy optim`` shards the optimizer state and the main gradients across the
instances too (each rank a 1/DP shard of the whole data-parallel group), and the same group then sums
the squares of 1/N of the gradient: measured with Megatron-LM's pretrain_gpt.py on 4 gloo ranks
(2 instances), grad norm 0.921 at iteration 1 where the distributed optimizer with the same instances
logs 1.212, and with the default ``--clip-grad 1.0`` the clipped step differs (lm loss 5.445468 at
iteration 3 against 5.445676). On every device: the group choice is megatron's, in Python.

The fix widens that group to every rank (megatron's group for one instance, which spans the world)
where Megatron-FSDP shards across the instances: ``use_megatron_fsdp``,
``num_distributed_optimizer_instances > 1`` and ``outer_dp_sharding_strategy`` other than
``no_shard``. Elsewhere megatron's group is returned unchanged.
"""

from __future__ import annotations

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-megatron-fsdp-hsdp-grad-norm"
VERSIONS = ">=0.14"
TARGET = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.get_grad_stats_parallel_group"


def sharded_across_instances(ddp_config) -> bool:
    """Whether Megatron-FSDP shards the gradients across the distributed-optimizer instances."""
    return (
        getattr(ddp_config, "use_megatron_fsdp", False)
        and getattr(ddp_config, "num_distributed_optimizer_instances", 1) > 1
        and getattr(ddp_config, "outer_dp_sharding_strategy", "no_shard") != "no_shard"
    )


def every_rank_when_sharded_across_instances(wrapped, instance, args, kwargs):
    group = wrapped(*args, **kwargs)
    if sharded_across_instances(getattr(instance, "ddp_config", None)):
        return torch.distributed.group.WORLD
    return group


PATCHES = [
    Patch(
        TARGET,
        Kind.WRAP,
        every_rank_when_sharded_across_instances,
        versions=VERSIONS,
        why="the grad norm of gradients sharded across the instances is summed over every instance",
    )
]

FEATURE = Feature(
    name=NAME,
    summary="--use-megatron-fsdp --outer-dp-sharding-strategy optim with --num-distributed-optimizer-instances > 1: "
    "the grad norm (and clipping) counts every instance's gradient shard, not its own instance's alone",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
