"""Fix: Megatron-FSDP's outer-DP sharding (``--outer-dp-sharding-strategy optim``) never averages the gradients.

Under hybrid sharding with outer-DP sharding megatron-core 0.19.2 keeps each parameter group's persistent
gradients in a helper buffer over the intra-instance group (``param_and_grad_buffer._create_hfsdp_helper_buffer``:
``hfsdp_helper_gbuf``), and ``GradReducePipeline._bucket_group_gradient_reduce`` reduce-scatters that helper
buffer with the helper's ``gradient_scaling_factor`` ("Pre-scale unsharded bucket gradient"), then the
outer reduce-scatter sums without scaling ("the (DP-Shard, DP-Outer) scaling is already applied"). The helper
is built from the main gradient buffer's layout, group and allocator but not its scaling factor: it is None,
``gradient_reduce_preprocessing`` then sums unscaled, and every gradient comes out data-parallel-size times
the average (on every device: NCCL's premultiplied sum is skipped the same way). Measured on 4 gloo ranks (DP 4
in 2 instances, the tiny GPT of tests/fsdp, ``optim_grads_params``): grad norm 3.216416 / 3.377856 / 3.358158
against the distributed optimizer's 0.804104 / 0.844458 / 0.839113 (4x, the data-parallel size), and with
megatron's default clip the clipped steps differ (loss 5.5268049 / 5.5710735 at steps 2-3 against 5.5268054 /
5.5710325); with plain SGD each step would be 4x as long. The same with MoE at EP 2 (grad norm 3.235705 against
0.808926).

The fix gives the helper buffer its main gradient buffer's scaling factor where megatron left it None.
megatron-core 0.16.1 has no helper buffer (its outer sharding measured right: docs/features/fsdp.md); 0.17.1 and
0.18.2 build it as 0.19.2 does (read, not run).
"""

from __future__ import annotations

import functools

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-megatron-fsdp-outer-grad-scaling"
VERSIONS = ">=0.17"
"""Read in 0.17.1, 0.18.2 and 0.19.2 (the same helper, built without the factor); run on 0.19.2."""
MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
TARGET = f"{MODULE}._create_hfsdp_helper_buffer"
SOURCE = "distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py"


@functools.cache
def _defines_helper(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as handle:
            return "def _create_hfsdp_helper_buffer(" in handle.read()
    except OSError:
        return False


def has_helper_buffers() -> bool:
    """Whether the installed megatron-core's Megatron-FSDP builds outer-DP helper buffers (read from its source,
    without importing megatron; the tests' skip)."""
    from mindspeed_like.megatron_version import core_file

    path = core_file(SOURCE)
    return path is not None and _defines_helper(path)


def keep_the_scaling_factor(wrapped, instance, args, kwargs):
    helper = wrapped(*args, **kwargs)
    factor = getattr(Call(wrapped, args, kwargs)["dp_buffer"], "gradient_scaling_factor", None)
    if getattr(helper, "gradient_scaling_factor", None) is None and factor is not None:
        helper.gradient_scaling_factor = factor
    return helper


PATCHES = [
    Patch(
        TARGET,
        Kind.WRAP,
        keep_the_scaling_factor,
        versions=VERSIONS,
        why="the outer-DP helper gradient buffer is built without the main buffer's 1/DP scaling factor",
    )
]

FEATURE = Feature(
    name=NAME,
    summary="--use-megatron-fsdp --outer-dp-sharding-strategy optim averages the gradients over the data-parallel "
    "ranks (megatron-core 0.19's outer-DP helper buffer summed them: gradients and grad norm DP times too large)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
