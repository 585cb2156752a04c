"""CPU adapter, megatron's Triton kernels: a portable path where megatron has no other.

``fusions.fused_indices_converter.fused_indices_to_multihot`` (0.13-0.19): the DeepEP/HybridEP
token dispatcher (``MoEFlexTokenDispatcher``) converts the router's top-k indices to a multihot
routing map with it, through a Triton kernel that allocates on ``device="cuda"`` and needs a GPU
(on a CPU host: "libcuda.so cannot found"). Megatron has no unfused fallback, so the adapter
replaces the function with the same conversion in torch operations
(``kernels/indices_multihot.py``, checked against megatron's own test of the kernel); the
dispatcher's module-level alias is re-pointed by the engine.
"""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.kernels.indices_multihot import indices_to_multihot


def fused_indices_to_multihot(indices, probs_indices, num_of_local_experts):
    """megatron's ``fused_indices_to_multihot`` (same arguments), computed by torch operations."""
    return indices_to_multihot(indices, probs_indices, num_of_local_experts)


PATCHES = [
    Patch(
        "megatron.core.fusions.fused_indices_converter.fused_indices_to_multihot",
        Kind.REPLACE,
        fused_indices_to_multihot,
        why="a Triton kernel on device='cuda' (needs a GPU); the flex dispatcher's only path",
    ),
]
