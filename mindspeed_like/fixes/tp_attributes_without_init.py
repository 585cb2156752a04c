"""Fix: with ``perform_initialization=False`` megatron's TP-sharded weights are not marked as such, so
its grad norm (and gradient clipping) counts TP rank 0's shards only (megatron-core 0.13-0.17).

megatron marks a tensor-parallel shard with ``tensor_model_parallel=True``, ``partition_dim`` and
``partition_stride`` (``set_tensor_model_parallel_attributes``). In 0.13-0.17 the only calls for the
weights of ``VocabParallelEmbedding``, ``ColumnParallelLinear``, ``RowParallelLinear`` (and the
legacy ``GroupedMLP``'s ``weight1`` / ``weight2``, 0.13-0.16) are inside
``_initialize_affine_weight_cpu`` / ``_initialize_affine_weight_gpu``, which those constructors call
only ``if config.perform_initialization`` (on both the ``use_cpu_initialization`` route and the
device route). Frameworks that load Hugging Face weights after building the model (ms-swift,
Megatron-Bridge's converters) build with ``perform_initialization=False``, and then every sharded
weight reads as a TP duplicate: ``param_is_not_tensor_parallel_duplicate`` keeps it on TP rank 0
only, so ``MegatronOptimizer.get_grad_norm`` / ``get_grad_norm_fp32`` and ``count_zeros_fp32`` leave
out the other ranks' shards, and ``clip_grad_norm_fp32`` clips with that too-small norm. Reported
with ms-swift at TP=2: grad norm 2.7967 at step 1 where TP=1, DP=2 and PP=2 give 3.2538.
Checkpoint resharding (``megatron.core.resharding``) and Muon read ``partition_dim`` too.
Not affected: ``ColumnParallelLinear``'s bias (marked unconditionally) and ``RowParallelLinear``'s
bias (not sharded; it gets ``sequence_parallel`` unconditionally).

megatron-core 0.18.0 fixed it upstream (each constructor's ``else`` branch calls
``set_tensor_model_parallel_attributes`` with the same dim and stride); 0.19.2 has the fix, 0.17.0
does not (read from the wheels of 0.13.1, 0.16.1, 0.17.0, 0.18.0 and 0.19.2).

The fix does what 0.18 does: after megatron's constructor, a weight that has none of the attributes
gets megatron's own ``set_tensor_model_parallel_attributes`` with the values the initialisation path
would have set (embedding: dim 0, stride 1; column: dim 0, the ``stride`` argument; row: dim 1, the
``stride`` argument; GroupedMLP: ``weight1`` dim 1, ``weight2`` dim 0, stride 1). A weight that has
them (``perform_initialization=True``) is left alone, so the fix changes nothing else.

Why the constructors are the targets: the attributes belong to the parameter as soon as it exists
(DDP's buffers, the optimizer's param groups and distributed checkpointing read them after
construction), and the constructor is where megatron itself sets them from 0.18. The te-backend's
column and row linears call these constructors (and set TE's attributes themselves too).

Stacking: above the cpu-adapter's host twin of each constructor, and above
fix-moe-expert-bias-inplace on ``RowParallelLinear.__init__`` (independent: each sets different
attributes on the built module).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import MOE_EXPERTS, TP_LAYERS

VERSIONS = "<0.18"  # 0.18.0 sets the attributes when perform_initialization is off
GROUPED_MLP_VERSIONS = "<0.17"  # GroupedMLP was deleted in 0.17
TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def mark_tensor_parallel(tensor: torch.Tensor | None, dim: int, stride: int) -> None:
    """Mark ``tensor`` as a TP shard along ``dim`` (megatron's call) unless it carries any of the
    attributes already (then megatron's initialisation, or a subclass, marked it: left as it is)."""
    if tensor is None or any(hasattr(tensor, name) for name in TP_ATTRIBUTES):
        return
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(tensor, is_parallel=True, dim=dim, stride=stride)


@functools.cache
def _constructor_signature(cls: type) -> inspect.Signature:
    """The signature of megatron's own ``cls.__init__`` (under every wrapper of it)."""
    return inspect.signature(inspect.unwrap(cls.__init__))


def _stride(cls: type, instance: Any, args: tuple, kwargs: dict) -> int:
    """The ``stride`` megatron's ``cls.__init__`` was called with. Bound against megatron's own
    function with the instance first: ``wrapped`` may be another feature's wrapper reached through
    an explicit ``cls.__init__(self, ...)`` call (the te-backend's subclasses), whose proxy reports
    the unbound signature."""
    bound = _constructor_signature(cls).bind(instance, *args, **kwargs)
    bound.apply_defaults()
    return int(bound.arguments.get("stride", 1))


def construct_embedding(wrapped, instance, args, kwargs) -> Any:
    result = wrapped(*args, **kwargs)
    mark_tensor_parallel(getattr(instance, "weight", None), 0, 1)
    return result


def construct_column(wrapped, instance, args, kwargs) -> Any:
    result = wrapped(*args, **kwargs)
    # weight is None with skip_weight_param_allocation (the output layer reading the embedding's)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    mark_tensor_parallel(getattr(instance, "weight", None), 0, _stride(ColumnParallelLinear, instance, args, kwargs))
    return result


def construct_row(wrapped, instance, args, kwargs) -> Any:
    result = wrapped(*args, **kwargs)
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    mark_tensor_parallel(getattr(instance, "weight", None), 1, _stride(RowParallelLinear, instance, args, kwargs))
    return result


def construct_grouped_mlp(wrapped, instance, args, kwargs) -> Any:
    result = wrapped(*args, **kwargs)
    mark_tensor_parallel(getattr(instance, "weight1", None), 1, 1)  # [hidden, fc1 per partition]
    mark_tensor_parallel(getattr(instance, "weight2", None), 0, 1)  # [fc2 per partition, hidden]
    return result


WHY = "perform_initialization=False leaves the TP-sharded weight unmarked: grad norm and clipping count TP rank 0 only"

PATCHES = [
    Patch(
        f"{TP_LAYERS}.VocabParallelEmbedding.__init__",
        Kind.WRAP,
        construct_embedding,
        versions=VERSIONS,
        after=("cpu-adapter",),
        why=WHY,
    ),
    Patch(
        f"{TP_LAYERS}.ColumnParallelLinear.__init__",
        Kind.WRAP,
        construct_column,
        versions=VERSIONS,
        after=("cpu-adapter",),
        why=WHY,
    ),
    Patch(
        f"{TP_LAYERS}.RowParallelLinear.__init__",
        Kind.WRAP,
        construct_row,
        versions=VERSIONS,
        after=("cpu-adapter", "fix-moe-expert-bias-inplace"),
        why=WHY,
    ),
    Patch(
        f"{MOE_EXPERTS}.GroupedMLP.__init__",
        Kind.WRAP,
        construct_grouped_mlp,
        versions=GROUPED_MLP_VERSIONS,
        after=("cpu-adapter",),
        why=WHY,
    ),
]

FEATURE = Feature(
    name="fix-tp-attributes-without-init",
    summary="perform_initialization=False: TP-sharded weights still marked tensor_model_parallel, so the "
    "grad norm and clipping count every TP rank's shard (megatron-core < 0.18)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
