"""An MoE routing map padded so each expert gets a multiple of ``pad_multiple`` tokens: megatron's
``fused_pad_routing_map`` (a Triton kernel, ``megatron.core.fusions.fused_pad_routing_map``) as torch
operations that run on any device.

Contract (megatron's kernel, 0.13-0.19): ``routing_map [tokens, experts]`` (bool or int), an int
``pad_multiple``. For each expert with ``n`` routed tokens, its first ``(-n) % pad_multiple`` unrouted
tokens (in token order) are routed too. The result is a new int32 tensor, the transposed view of a
contiguous ``[experts, tokens]`` one, as the kernel returns it; the input is not written (megatron's
unfused ``moe_utils.pad_routing_map`` writes its input in place and keeps its dtype). No tokens: the
input itself.

Why: the alltoall and flex dispatchers call it under ``moe_router_padding_for_quantization`` with
``moe_permute_fusion`` and ``config.ENABLE_EXPERIMENTAL``; the Triton kernel needs a GPU ("libcuda.so
cannot found" on a CPU host), and a level-1 run serves ``moe_permute_fusion`` on the host.
"""

from __future__ import annotations

import torch


def pad_routing_map(routing_map: torch.Tensor, pad_multiple: int) -> torch.Tensor:
    """``routing_map`` with each expert's token count padded up to a multiple of ``pad_multiple``."""
    if routing_map.dim() != 2:
        raise ValueError(f"routing_map must be [tokens, experts], got shape {tuple(routing_map.shape)}")
    if int(pad_multiple) < 1:
        raise ValueError(f"pad_multiple must be a positive integer, got {pad_multiple}")
    if routing_map.shape[0] == 0:
        return routing_map
    by_expert = routing_map.transpose(0, 1).contiguous().int()  # [experts, tokens]
    short = (-by_expert.sum(dim=1)) % int(pad_multiple)
    unrouted = by_expert == 0
    rank_among_unrouted = torch.cumsum(unrouted.int(), dim=1)
    added = unrouted & (rank_among_unrouted <= short.unsqueeze(1))
    return torch.where(added, torch.ones_like(by_expert), by_expert).transpose(0, 1)
