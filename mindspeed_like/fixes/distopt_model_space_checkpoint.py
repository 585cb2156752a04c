"""Fix: the DistributedOptimizer's ``fully_sharded_model_space`` checkpoint cannot be saved (0.15+).

``DistributedOptimizer.sharded_state_dict`` uses ``fully_sharded_model_space`` when the caller
passes no ``metadata["distrib_optim_sharding_type"]`` (a user script calling
``optimizer.sharded_state_dict(model_state)``). Each data-parallel rank owns a contiguous range
of each FLATTENED parameter, and megatron describes it as the model's ShardedTensor with a
``flattened_range``, which ``ShardedTensor`` itself rejects from megatron-core 0.15 on: every
save fails with "ShardedTensor.flattened_range is not supported" (measured on 0.16.1 and 0.19.2,
any device; 0.13 and 0.14 still accept it and are left alone).

Here the same state is described without flattened ranges: a contiguous flat range of a
row-major tensor is a union of at most ``2 * ndim - 1`` rectangular blocks (a partial first row,
whole rows, a partial last row, recursively), each a plain ShardedTensor of the optimizer-state
key megatron uses (``optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<model key>``) with the
model's global shape and offsets plus the block's, on an irregular grid
(``axis_fragmentations=None``: megatron defers that validation to torch's checkpoint planner,
which checks coverage and overlap). The stored tensors are the canonical model-space tensors
megatron's own format describes, so the checkpoint stays model-space (any DP size can read it).
On load the blocks of each state are concatenated back to the rank's flat range before
megatron's own ``load_parameter_state_from_fs_model_space`` copies them in.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import DISTRIB_OPTIMIZER

DISTOPT = f"{DISTRIB_OPTIMIZER}.DistributedOptimizer"
VERSIONS = ">=0.15"  # ShardedTensor rejects flattened_range from 0.15 on
REUSE = "reuse-fp32-param"

Block = tuple[tuple[int, ...], tuple[int, ...]]  # (offset in the tensor, shape); row-major contiguous


def flat_range_blocks(shape: tuple[int, ...], start: int, end: int) -> list[Block]:
    """The rectangular blocks, in flat order, whose union is ``[start, end)`` of the flattened
    row-major tensor of ``shape``; each block is contiguous in that flat order."""
    if not 0 <= start < end <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {end}) is empty or outside a tensor of shape {tuple(shape)}")
    if len(shape) == 1:
        return [((start,), (end - start,))]
    row = math.prod(shape[1:])
    inner = tuple(shape[1:])

    def within_row(index: int, lo: int, hi: int) -> list[Block]:
        return [((index, *offset), (1, *size)) for offset, size in flat_range_blocks(inner, lo, hi)]

    first, last = start // row, (end - 1) // row
    if first == last:
        return within_row(first, start - first * row, end - first * row)
    blocks: list[Block] = []
    whole_from = first
    if start % row:
        blocks += within_row(first, start % row, row)
        whole_from = first + 1
    whole_to = end // row
    if whole_to > whole_from:
        blocks.append(((whole_from, *(0,) * len(inner)), (whole_to - whole_from, *inner)))
    if end % row:
        blocks += within_row(whole_to, 0, end % row)
    return blocks


def _block_tensors(state: torch.Tensor, model_tensor: Any, key: str, item: slice, replica_id: tuple) -> list:
    """``state`` (this rank's flat range ``item`` of the parameter) as one ShardedTensor per block."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    prepend = model_tensor.prepend_axis_num
    shards = []
    for offset, shape in flat_range_blocks(tuple(model_tensor.local_shape), item.start, item.stop):
        lo = sum(o * math.prod(model_tensor.local_shape[i + 1 :]) for i, o in enumerate(offset)) - item.start
        # prepended axes (e.g. the layer axis) folded into the block as size-1 axes: megatron's
        # irregular-grid path hands local shapes to torch as they are
        shape = (1,) * prepend + shape
        data = state[lo : lo + math.prod(shape)].view(shape)
        global_offset = (
            *model_tensor.global_offset[:prepend],
            *(g + o for g, o in zip(model_tensor.global_offset[prepend:], offset)),
        )
        shards.append(
            ShardedTensor(
                key=key,
                data=data,
                dtype=data.dtype,
                local_shape=shape,
                global_shape=tuple(model_tensor.global_shape),
                global_offset=global_offset,
                axis_fragmentations=None,
                replica_id=replica_id,
                allow_shape_mismatch=model_tensor.allow_shape_mismatch,
            )
        )
    return shards


def _model_space_state(wrapped, instance, args, kwargs):
    return model_space_state(instance, *args, **kwargs)


def model_space_state(
    distopt: Any, model_sharded_state_dict: dict, is_loading: bool = False, metadata: dict | None = None
) -> dict:
    """megatron's ``sharded_param_state_fs_model_space`` (same keys, same order of parameters),
    each rank's flat range as rectangular blocks instead of a ``flattened_range``."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    model_tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    by_param = {sharded.data: sharded for sharded in nested_values(model_tensors)}
    state: dict[int, dict] = {}
    for model_param, param_range_map in _params_in_buffer_order(distopt):
        model_tensor = by_param.get(model_param)
        if model_tensor is None:
            raise ValueError(
                f"a parameter of shape {tuple(model_param.shape)} is not in the model's sharded state dict: "
                "build it with keep_vars=True (model.sharded_state_dict() does) and pass it to "
                "optimizer.sharded_state_dict(model_state_dict)"
            )
        if isinstance(model_tensor, ShardedTensorFactory):
            raise NotImplementedError(
                f"{model_tensor.key}: the fully_sharded_model_space DistributedOptimizer format cannot describe "
                "a parameter saved through a ShardedTensorFactory on megatron-core 0.15+ (flattened ranges "
                "were removed); save with metadata={'distrib_optim_sharding_type': 'dp_reshardable'} "
                "(Megatron-LM's default) or 'fully_reshardable'"
            )
        replica_id = (*model_tensor.replica_id[:2], distopt.distributed_optimizer_instance_id)
        item = slice(param_range_map["param"].start, param_range_map["param"].end)
        tensors = distopt._get_main_param_and_optimizer_states(model_param)
        tensors["fp32_param"] = tensors.pop("param")
        for key, value in tensors.items():
            if key != "step":  # a 0-dim tensor; megatron keeps the step in the param groups
                tensors[key] = _block_tensors(
                    value, model_tensor, f"optimizer.state.{key}.{model_tensor.key}", item, replica_id
                )
        state[len(state)] = tensors
    return state


def _params_in_buffer_order(distopt: Any):
    """(model parameter, its range map) in the order megatron numbers them in this format."""
    for gbuf_range_maps in distopt.gbuf_ranges:
        for gbuf_range_map_for_all_buckets in gbuf_range_maps.values():
            for gbuf_range_map in gbuf_range_map_for_all_buckets:
                yield from gbuf_range_map["param_map"].items()


def _load_blocks_as_ranges(wrapped, instance, args, kwargs):
    (state_dict,) = args or (kwargs["state_dict"],)
    joined = {
        index: {
            key: torch.cat([block.reshape(-1) for block in value]) if isinstance(value, list) else value
            for key, value in tensors.items()
        }
        for index, tensors in state_dict.items()
    }
    return wrapped(joined)


PATCHES = [
    Patch(
        f"{DISTOPT}.sharded_param_state_fs_model_space",
        Kind.WRAP,
        _model_space_state,
        versions=VERSIONS,
        why="each rank's flat range as rectangular ShardedTensors (flattened_range is rejected from 0.15)",
    ),
    Patch(
        f"{DISTOPT}.load_parameter_state_from_fs_model_space",
        Kind.WRAP,
        _load_blocks_as_ranges,
        versions=VERSIONS,
        before=(REUSE,),
        why="the loaded blocks of each state joined back into the rank's flat range",
    ),
]

FEATURE = Feature(
    name="fix-distopt-model-space-checkpoint",
    summary="the DistributedOptimizer's default fully_sharded_model_space checkpoint saves and loads on "
    "megatron-core 0.15+ (flattened ranges as rectangular blocks)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
