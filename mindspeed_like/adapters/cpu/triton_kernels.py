"""CPU adapter, megatron's Triton kernels: a portable path where megatron has no other.

``fusions.fused_indices_converter.fused_indices_to_multihot`` (0.13-0.19): the DeepEP/HybridEP
token dispatcher (``MoEFlexTokenDispatcher``) converts the router's top-k indices to a multihot
routing map with it, through a Triton kernel that allocates on ``device="cuda"`` and needs a GPU
(on a CPU host: "libcuda.so cannot found"). Megatron has no unfused fallback, so the adapter
replaces the function with the same conversion in torch operations
(``kernels/indices_multihot.py``, checked against megatron's own test of the kernel); the
dispatcher's module-level alias is re-pointed by the engine.

``fusions.fused_mla_yarn_rope_apply.fused_apply_mla_rope_for_q`` / ``_for_kv`` (0.16-0.19): multi-latent
attention with ``apply_rope_fusion`` (and a YaRN ``rope_type``) takes cos/sin from
``get_cached_cos_sin`` and calls only these two (``multi_latent_attention``'s module-level aliases),
four Triton kernels on the GPU ("libcuda.so cannot found" on a CPU host). Replaced by the same
contract in torch operations (``kernels/mla_yarn_rope.py``: forward in place for the query, new
key/value tensors, gradients, sbhd and thd with context-parallel positions). 0.13's functions have
no ``cp_rank``/``cp_size`` (its callers pass the arguments before them), and the defaults (0, 1) give
0.13's thd positions. Before 0.16 both are ``@experimental_fn``: megatron raises
``ExperimentalNotEnabledError`` unless ``config.ENABLE_EXPERIMENTAL``, and their replacements there keep
that gate.

``fusions.fused_pad_routing_map.fused_pad_routing_map`` (0.13-0.19): the alltoall and flex dispatchers
pad each expert's tokens to the quantization alignment with it under ``moe_router_padding_for_quantization``
when ``moe_permute_fusion`` and ``config.ENABLE_EXPERIMENTAL`` are on (otherwise megatron's unfused
``pad_routing_map``); a Triton kernel on the GPU. Replaced by the same contract in torch operations
(``kernels/pad_routing_map.py``: a new int32 map, the input unwritten). megatron's unit test
``test_router_padding_for_fp8_forward_backward[True-True-*]`` reached it at level 1, where the host serves
``moe_permute_fusion``, and stopped there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.kernels.indices_multihot import indices_to_multihot
from mindspeed_like.kernels.mla_yarn_rope import mla_rope_kv, mla_rope_q
from mindspeed_like.kernels.pad_routing_map import pad_routing_map

MLA_ROPE = "megatron.core.fusions.fused_mla_yarn_rope_apply"


def fused_indices_to_multihot(indices, probs_indices, num_of_local_experts):
    """megatron's ``fused_indices_to_multihot`` (same arguments), computed by torch operations."""
    return indices_to_multihot(indices, probs_indices, num_of_local_experts)


def fused_pad_routing_map(routing_map, pad_multiple):
    """megatron's ``fused_pad_routing_map`` (same arguments), computed by torch operations."""
    return pad_routing_map(routing_map, pad_multiple)


def _experimental(fn: Callable) -> Callable:
    """``fn`` behind megatron's experimental flag, as ``@experimental_fn`` put the functions it replaces
    (megatron-core 0.13-0.15): the same error, raised at the call."""

    @functools.wraps(fn)
    def gated(*args, **kwargs):
        from megatron.core import config
        from megatron.core.utils import ExperimentalNotEnabledError

        if config.is_experimental_enabled() is not True:
            raise ExperimentalNotEnabledError("Flag config.ENABLE_EXPERIMENTAL not enabled.")
        return fn(*args, **kwargs)

    return gated


def _mla_rope(name: str, fn: Callable) -> list[Patch]:
    why = "Triton kernels (need a GPU); MLA's only RoPE path under apply_rope_fusion"
    return [
        Patch(f"{MLA_ROPE}.{name}", Kind.REPLACE, fn, why=why, versions=">=0.16"),
        Patch(f"{MLA_ROPE}.{name}", Kind.REPLACE, _experimental(fn), why=why + " (experimental)", versions="<0.16"),
    ]


PATCHES = [
    Patch(
        "megatron.core.fusions.fused_indices_converter.fused_indices_to_multihot",
        Kind.REPLACE,
        fused_indices_to_multihot,
        why="a Triton kernel on device='cuda' (needs a GPU); the flex dispatcher's only path",
    ),
    Patch(
        "megatron.core.fusions.fused_pad_routing_map.fused_pad_routing_map",
        Kind.REPLACE,
        fused_pad_routing_map,
        why="a Triton kernel (needs a GPU); the dispatchers' padding path under moe_permute_fusion",
    ),
    *_mla_rope("fused_apply_mla_rope_for_q", mla_rope_q),
    *_mla_rope("fused_apply_mla_rope_for_kv", mla_rope_kv),
]
