"""moe-permute's mechanism: megatron's MoE token permutation runs through
``mindspeed_like.kernels.moe_permute`` (one autograd Function per op, saving indices; torch_npu's
``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` on NPU).

Targets, and why each is the right symbol:

- ``transformer.moe.moe_utils.permute`` / ``unpermute`` / ``sort_chunks_by_idxs`` (WRAP): every
  token dispatcher (allgather, alltoall; 0.13-0.19) calls these three by name, imported from
  ``moe_utils`` (the engine re-points ``token_dispatcher``'s aliases). Their ``fused=True``
  branches reach TransformerEngine's kernels through names that ``moe_utils`` binds only when
  ``import transformer_engine`` succeeds (without TE they do not exist and ``HAVE_TE`` is False,
  so the branch raises): wrapping the functions serves both branches, whatever
  ``moe_permute_fusion`` says. Arguments are read by name from the installed signature (0.19 adds
  ``tokens_per_expert``/``align_size`` to permute, returning 5 values, and ``pad_offsets`` to
  unpermute). Given ``pad_offsets`` (only TE's permute-and-pad kernel makes them), the call goes
  back to megatron (said once).
- ``transformer.transformer_config.TransformerConfig.__post_init__`` (WRAP): with
  ``moe_permute_fusion`` it runs ``from ...moe.moe_utils import fused_permute, ...`` (0.13-0.19)
  and raises when one is None; without TE those names do not exist in ``moe_utils`` at all
  (ImportError), and the engine creates no attribute. That check is the only use of the field in
  ``__post_init__``, so the wrapper runs it with ``moe_permute_fusion`` False and sets it back
  afterwards: the config keeps ``True`` and the dispatchers take their fused branches (which
  reach our kernel through the wrappers above). Sits above te-backend's wrapper of the same
  method (which would otherwise switch the field off for good, said as a fallback).
- ``extensions.transformer_engine.fused_permute``, ``fused_permute_with_probs``,
  ``fused_unpermute``, ``fused_sort_chunks_by_index``, ``fused_sort_chunks_by_index_with_probs``
  (REPLACE, no aliases: without TE they are ``None``, and every other ``None`` in megatron must
  stay one): where megatron binds TransformerEngine's kernels (``moe_utils`` imports them from
  there when TE imports). They take TransformerEngine's arguments (a ``row_id_map`` of ours,
  ``[2, rows]``: token and flat ``expert * tokens + token`` index of each row), portable
  backend, for code calling them directly.
  0.19's ``fused_permute_and_pad_with_probs`` stays None: megatron then takes
  ``fused_permute_with_probs`` (no alignment padding), as with TE < 2.12.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.fallback import Fallback


@dataclass(frozen=True)
class PermuteWrapper:
    """``moe_utils.permute``: our kernel for every call, fused or not. ``fixed_count``: megatron-core
    0.19+ selects a dropless map's rows with an argsort cut at ``num_out_tokens`` (no host read);
    the kernel does the same there, where older releases' ``masked_select`` (a host read) is
    matched by ``nonzero``."""

    fixed_count: bool = False

    def __call__(self, wrapped, instance, args, kwargs):
        from mindspeed_like.kernels.moe_permute import permute

        call = Call(wrapped, args, kwargs)
        permuted, permuted_probs, sorted_indices = permute(
            call["tokens"],
            call["routing_map"],
            probs=call["probs"],
            num_out_tokens=call["num_out_tokens"],
            drop_and_pad=call["drop_and_pad"],
            fixed_count=self.fixed_count,
        )
        if "tokens_per_expert" in call:  # megatron-core 0.19: (..., pad_offsets, tokens_per_expert)
            return permuted, permuted_probs, sorted_indices, None, call["tokens_per_expert"]
        return permuted, permuted_probs, sorted_indices


@dataclass(frozen=True)
class UnpermuteWrapper:
    """``moe_utils.unpermute``: our kernel, except for TE's padded layout (``pad_offsets``)."""

    fallback: Fallback

    def __call__(self, wrapped, instance, args, kwargs):
        from mindspeed_like.kernels.moe_permute import unpermute

        call = Call(wrapped, args, kwargs)
        if call.get("pad_offsets") is not None:
            self.fallback("unpermute with pad_offsets (TransformerEngine's permute-and-pad layout)")
            return wrapped(*args, **kwargs)
        return unpermute(
            call["permuted_tokens"],
            call["sorted_indices"],
            call["restore_shape"],
            probs=call["probs"],
            routing_map=call["routing_map"],
            drop_and_pad=call["drop_and_pad"],
        )


@dataclass(frozen=True)
class SortChunksWrapper:
    """``moe_utils.sort_chunks_by_idxs`` (alltoall with several local experts): one row gather."""

    def __call__(self, wrapped, instance, args, kwargs):
        from mindspeed_like.kernels.moe_permute import sort_chunks_by_idxs

        call = Call(wrapped, args, kwargs)
        return sort_chunks_by_idxs(call["input"], call["split_sizes"], call["sorted_idxs"], probs=call["probs"])


@dataclass(frozen=True)
class ConfigPostInit:
    """``TransformerConfig.__post_init__``: megatron's TE-availability check of
    ``moe_permute_fusion`` skipped while our kernel provides the fusion."""

    def __call__(self, wrapped, instance, args, kwargs):
        if instance is None or not getattr(instance, "moe_permute_fusion", False) or _te_fusion_in_moe_utils():
            return wrapped(*args, **kwargs)
        instance.moe_permute_fusion = False
        try:
            return wrapped(*args, **kwargs)
        finally:
            instance.moe_permute_fusion = True


def _te_fusion_in_moe_utils() -> bool:
    """TransformerEngine's fused permute is importable from ``moe_utils`` (TE installed)."""
    from megatron.core.transformer.moe import moe_utils

    return getattr(moe_utils, "fused_permute", None) is not None


# -- TransformerEngine's names (transformer_engine.pytorch.permutation's API, mask map) -----------


def _row_id_map(token_idx: torch.Tensor, flat_idx: torch.Tensor) -> torch.Tensor:
    return torch.stack((token_idx, flat_idx))


def fused_permute(
    inp: torch.Tensor,
    routing_map: torch.Tensor,
    num_out_tokens: int = -1,
    max_token_num: int = -1,
    map_type: str = "mask",
) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's ``moe_permute`` (mask map): ``(permuted, row_id_map)``."""
    from mindspeed_like.kernels.moe_permute import permute_with_index

    _mask_only(map_type)
    permuted, _, token_idx, flat_idx = permute_with_index(inp, routing_map, None, _out_tokens(num_out_tokens))
    return permuted, _row_id_map(token_idx, flat_idx)


def fused_permute_with_probs(
    inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int = -1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TE's ``moe_permute_with_probs``: ``(permuted, permuted_probs, row_id_map)``."""
    from mindspeed_like.kernels.moe_permute import permute_with_index

    permuted, permuted_probs, token_idx, flat_idx = permute_with_index(
        inp, routing_map, probs, _out_tokens(num_out_tokens)
    )
    return permuted, permuted_probs, _row_id_map(token_idx, flat_idx)


def fused_unpermute(
    inp: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None = None,
    restore_shape: torch.Size | None = None,
    map_type: str = "mask",
    probs: torch.Tensor | None = None,
    pad_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """TE's ``moe_unpermute`` (mask map) for a ``row_id_map`` from :func:`fused_permute`."""
    from mindspeed_like.kernels.moe_permute import unpermute_with_index

    _mask_only(map_type)
    if pad_offsets is not None:
        raise ValueError("fused_unpermute: pad_offsets (TE's permute-and-pad layout) are not supported")
    merging_probs = merging_probs if merging_probs is not None else probs
    if restore_shape is None:
        if merging_probs is None:
            raise ValueError("fused_unpermute: pass restore_shape (or merging_probs): the row map does not hold it")
        restore_shape = (merging_probs.shape[0], inp.shape[1])
    if row_id_map.dim() != 2 or row_id_map.shape[0] != 2:
        raise ValueError("fused_unpermute: row_id_map must come from mindspeed_like's fused_permute ([2, rows])")
    return unpermute_with_index(inp, row_id_map[0], row_id_map[1], restore_shape, merging_probs)


def fused_sort_chunks_by_index(
    inp: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor
) -> torch.Tensor:
    """TE's ``moe_sort_chunks_by_index``."""
    from mindspeed_like.kernels.moe_permute import sort_chunks_by_idxs

    return sort_chunks_by_idxs(inp, split_sizes, sorted_index)[0]


def fused_sort_chunks_by_index_with_probs(
    inp: torch.Tensor, probs: torch.Tensor, split_sizes: torch.Tensor, sorted_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's ``moe_sort_chunks_by_index_with_probs``."""
    from mindspeed_like.kernels.moe_permute import sort_chunks_by_idxs

    return sort_chunks_by_idxs(inp, split_sizes, sorted_index, probs=probs)


def _out_tokens(num_out_tokens) -> int | None:
    if num_out_tokens is None:
        return None
    value = int(num_out_tokens)
    return None if value < 0 else value


def _mask_only(map_type: str) -> None:
    if map_type != "mask":
        raise ValueError(f"map_type {map_type!r}: only megatron's routing-map ('mask') layout is provided")


TE_FUNCTIONS = {
    "fused_permute": fused_permute,
    "fused_permute_with_probs": fused_permute_with_probs,
    "fused_unpermute": fused_unpermute,
    "fused_sort_chunks_by_index": fused_sort_chunks_by_index,
    "fused_sort_chunks_by_index_with_probs": fused_sort_chunks_by_index_with_probs,
}
"""The names ``TransformerConfig.__post_init__`` requires for ``moe_permute_fusion``."""
