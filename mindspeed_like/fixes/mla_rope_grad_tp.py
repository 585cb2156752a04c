"""Fix: megatron's local-spec multi-latent attention at TP>1 drops part of the shared rope key's gradient.

``MLASelfAttention`` computes ``kv_combined = [kv_compressed; k_pos_emb]`` with
``linear_kv_down_proj``. On megatron's local spec that linear is a ``ColumnParallelLinear`` (its
output split over TP by columns), so ``get_query_key_value_tensors`` restores the whole
``kv_combined`` with ``gather_from_tensor_model_parallel_region`` and splits it. That function's
backward is a split: each rank keeps only its own columns of ITS gradient. ``kv_compressed`` is
fine (it enters ``linear_kv_up_proj``, a column-parallel linear whose input gradient is all-reduced
over TP, or reduce-scattered under SP, before it reaches the gather). ``k_pos_emb`` is not: it is
ONE rope key shared by all heads (``expand`` over this rank's heads), and each TP rank holds only
its heads, so each rank's gradient of it is a partial sum over its own heads, which the split
then throws away except for the columns this rank owns. Result at TP>1 (with or without SP):
``linear_kv_down_proj``'s rope rows, and through ``d hidden`` the input norm, the layers below and
the embedding, get wrong gradients. Measured on 0.16.1 (tiny MLA GPT, one forward/backward, TP=2
vs TP=1, largest difference relative to the TP=1 gradient's largest entry; the same with and
without SP): layer 0/1's ``linear_kv_down_proj`` 1.7e-3 / 2.1e-3, input norms 9.4e-4 / 2.3e-3, the
embedding 3.8e-5; with this fix every parameter is within 4.9e-7 of TP=1
(``tests/fixes/test_mla_rope_grad_tp.py``).
The same code is in 0.13.1, 0.16.1 and 0.19.2 (0.19 moved the down projections into
``_qkv_down_projection``; the gather and split stayed in ``get_query_key_value_tensors``);
upstream issue NVIDIA/Megatron-LM#1699 (July 2025) is open, no release up to 0.19.2 has a fix.

The fix: the gradient of the gathered ``kv_combined``'s last ``qk_pos_emb_head_dim`` columns
(``k_pos_emb``) is all-reduced over the TP group before megatron's split, i.e. what
``copy_to_tensor_model_parallel_region`` on ``k_pos_emb`` would do: identity forward (nothing is
copied), one all-reduce of ``[s, b, qk_pos_emb_head_dim]`` in backward. The other columns are left
as they are (already summed; summing them again would multiply them by TP).

Targets (two, both narrow):
- ``MLASelfAttention.__init__`` (WRAP): after megatron builds the module, if its
  ``linear_kv_down_proj`` returns TP-sharded columns (``output_size_per_partition`` smaller than
  ``kv_lora_rank + qk_pos_emb_head_dim``: a ``ColumnParallelLinear`` at TP>1), a forward hook marks
  its output tensor with the rope width. The TE spec's duplicated ``TELinear`` returns whole rows and
  is never marked (its ``k_pos_emb`` is gathered over sequence shards, whose backward reduce-scatters).
- ``multi_latent_attention.gather_from_tensor_model_parallel_region`` (WRAP, this module's name
  only, ``update_aliases=False``): for a marked tensor the result gets the rope-gradient sum; every
  other call (the ``q_compressed`` gather, and every module outside MLA) is megatron's, untouched.
Why not one target: the gather cannot tell ``kv_combined`` from ``q_compressed`` (same call, and
their widths may be equal), and after the gather's split the other ranks' parts are gone, so a hook
on the linear's output alone cannot repair it.

Not covered: megatron-core 0.19's ``FusedMLASelfAttention`` (``mla_down_proj_fusion``, TE spec
only) splits ``kv_combined`` out of a fused projection that the hook does not see; with the TE
spec's duplicated linear it takes the sequence-parallel path anyway. The TE spec WITHOUT sequence
parallelism at TP>1 has a related gap (no gather at all; upstream PR NVIDIA/Megatron-LM#6839, open)
that this fix does not touch.
"""

from __future__ import annotations

from typing import Any

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import CORE

MLA = f"{CORE}.transformer.multi_latent_attention"
ROPE_WIDTH = "_mindspeed_like_shared_rope_width"
"""Attribute set on ``linear_kv_down_proj``'s output tensor: the number of trailing columns
(``qk_pos_emb_head_dim``) of the gathered tensor whose gradient must be summed over TP."""


class SumSharedRopeGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces the last ``width`` columns of the gradient over
    ``group`` and passes the others through (see the module docstring)."""

    @staticmethod
    def forward(ctx, combined: torch.Tensor, width: int, group) -> torch.Tensor:
        ctx.width, ctx.group = width, group
        return combined.view_as(combined)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        width = ctx.width
        rope = grad[..., -width:].contiguous()
        torch.distributed.all_reduce(rope, group=ctx.group)
        return torch.cat([grad[..., :-width], rope], dim=-1), None, None


def sum_shared_rope_grad(combined: torch.Tensor, width: int, group) -> torch.Tensor:
    """``combined`` unchanged; its trailing ``width`` columns' gradient summed over ``group``."""
    if torch.distributed.get_world_size(group=group) == 1:
        return combined
    return SumSharedRopeGrad.apply(combined, width, group)


def _mark_rope_columns(module: torch.nn.Module, inputs: Any, output: Any) -> None:
    tensor = output[0] if isinstance(output, tuple) else output
    setattr(tensor, ROPE_WIDTH, module._mindspeed_like_rope_width)


def returns_sharded_columns(linear: torch.nn.Module, config) -> bool:
    """True when megatron's ``get_query_key_value_tensors`` gathers this ``linear_kv_down_proj``'s
    output over TP (its own test: the output is narrower than ``kv_lora_rank + qk_pos_emb_head_dim``)."""
    full = config.kv_lora_rank + config.qk_pos_emb_head_dim
    per_partition = getattr(linear, "output_size_per_partition", full)
    return per_partition != full


def construct_mla(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    linear = getattr(instance, "linear_kv_down_proj", None)
    if linear is not None and returns_sharded_columns(linear, instance.config):
        linear._mindspeed_like_rope_width = instance.config.qk_pos_emb_head_dim
        linear.register_forward_hook(_mark_rope_columns)
    return result


def gather_kv_combined(wrapped, instance, args, kwargs):
    output = wrapped(*args, **kwargs)
    input_ = args[0] if args else kwargs.get("input_")
    width = getattr(input_, ROPE_WIDTH, None)
    if not width:
        return output
    from megatron.core import parallel_state

    group = kwargs.get("group") or (args[1] if len(args) > 1 else None)
    if group is None:  # megatron calls it without a group: its default TP group, as the gather used
        group = parallel_state.get_tensor_model_parallel_group()
    return sum_shared_rope_grad(output, width, group)


VERSIONS = ">=0.13"  # the same gather/split in 0.13.1, 0.16.1 and 0.19.2; upstream #1699 still open

PATCHES = [
    Patch(
        f"{MLA}.MLASelfAttention.__init__",
        Kind.WRAP,
        construct_mla,
        versions=VERSIONS,
        why="marks a TP-sharded linear_kv_down_proj's output (its rope columns' gradient is summed in the gather)",
    ),
    Patch(
        f"{MLA}.gather_from_tensor_model_parallel_region",
        Kind.WRAP,
        gather_kv_combined,
        update_aliases=False,
        versions=VERSIONS,
        why="the gather's backward keeps one rank's part of the shared k_pos_emb gradient: sum it over TP",
    ),
]

FEATURE = Feature(
    name="fix-mla-rope-grad-tp",
    summary="local-spec multi-latent attention at TP>1: the shared rope key's gradient is summed over TP "
    "(upstream NVIDIA/Megatron-LM#1699)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
