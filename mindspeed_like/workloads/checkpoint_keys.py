"""Copy weights between two megatron models by their distributed-checkpoint keys.

megatron names the same weight differently in modules of different specs (a local-spec layer's
``input_layernorm.weight`` is a TE-spec layer's ``self_attention.linear_qkv.layer_norm_weight``;
SequentialMLP's ``experts.local_experts.3.linear_fc1.weight`` is a grouped linear's
``experts.linear_fc1.weight3``), but gives both the same key and global offset in its distributed
checkpoint, which is how a checkpoint moves between specs. :func:`copy_weights` matches on exactly
that (after expanding megatron's sharded-tensor factories, e.g. the gated fc1's two halves), so
a test compares the two specs on identical weights without a hand-written name map, and proves
the checkpoint keys line up. Where megatron's spec forgets its own renaming (the local MLA layer
declares no ``sharded_state_dict_keys_map``, so its pre-MLP norm keeps its local name), the local
spec's map, read from megatron's ``get_gpt_layer_local_spec()``, is applied to parameter names. A
weight matched by none of these is an error naming it.
"""

from __future__ import annotations

import torch


def _sharded_tensors(model: torch.nn.Module) -> dict[str, object]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model.sharded_state_dict()
    apply_factories(state)
    tensors: dict[str, object] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, (list, tuple)):
            for index, inner in enumerate(value):
                walk(f"{prefix}.{index}", inner)
        elif isinstance(value, ShardedTensor):
            tensors[prefix] = value

    walk("", state)
    return tensors


def local_spec_keys_map() -> dict[str, str]:
    """megatron's local-spec renaming of norms to their TE-spec names (e.g. ``input_layernorm.`` ->
    ``self_attention.linear_qkv.layer_norm_``), read from the installed megatron."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return dict(getattr(get_gpt_layer_local_spec().submodules, "sharded_state_dict_keys_map", None) or {})


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> int:
    """Copy every weight of ``dst`` from ``src`` (same checkpoint key and global offset, else the
    same state-dict name); returns the number of tensors copied."""
    source = _sharded_tensors(src)
    by_key = {(t.key, tuple(t.global_offset), tuple(t.local_shape)): t for t in source.values()}
    for name, tensor in list(source.items()):
        for local, te in local_spec_keys_map().items():
            for old, new in ((local, te), (te, local)):
                if old in name:
                    source.setdefault(name.replace(old, new), tensor)
    copied, unmatched = 0, []
    with torch.no_grad():
        for name, target in _sharded_tensors(dst).items():
            match = by_key.get((target.key, tuple(target.global_offset), tuple(target.local_shape)))
            if match is None and name in source and source[name].data.shape == target.data.shape:
                match = source[name]
            if match is None:
                gathered = _gathered_over_tp(target, source.values())
                if gathered is not None:
                    target.data.copy_(gathered)
                    copied += 1
                    continue
            if match is None:
                unmatched.append(f"{name} (key {target.key}, offset {tuple(target.global_offset)})")
                continue
            target.data.copy_(match.data)
            copied += 1
    if unmatched:
        raise KeyError(f"no weight in the source model for: {', '.join(unmatched)}")
    return copied


def _gathered_over_tp(target, source) -> torch.Tensor | None:
    """``target``'s whole tensor from the source's tensor-parallel shards of the same key: a weight
    one spec shards over TP and the other replicates (MLA's down projections: the local spec's
    ColumnParallelLinear, the TE spec's duplicated TELinear), all-gathered over the TP group and
    concatenated along the one axis where the shapes differ. Collective: every TP rank calls it."""
    candidates = [
        t
        for t in source
        if t.key == target.key
        and tuple(t.global_shape) == tuple(target.global_shape)
        and tuple(t.global_offset[: t.prepend_axis_num]) == tuple(target.global_offset[: target.prepend_axis_num])
    ]
    if len(candidates) != 1 or not torch.distributed.is_initialized():
        return None
    shard = candidates[0].data
    axes = [i for i, (a, b) in enumerate(zip(shard.shape, target.data.shape)) if a != b]
    if len(axes) != 1:
        return None
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(shard) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(pieces, shard.contiguous(), group=group)
    whole = torch.cat(pieces, dim=axes[0])
    return whole if whole.shape == target.data.shape else None
