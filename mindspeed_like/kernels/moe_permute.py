"""MoE token permute / unpermute, each one autograd Function (forward and backward).

``permute`` groups the rows of ``tokens`` by expert (``routing_map`` ``[tokens, experts]`` bool),
carrying ``probs`` along; ``unpermute`` scatter-adds expert outputs back to their tokens,
optionally weighted by ``probs``. Semantics are megatron-core's unfused
``moe_utils.permute/unpermute`` (0.13-0.19): dropless (rows in expert-major order, tokens
ascending inside an expert) and drop-and-pad (``capacity = num_out_tokens // experts`` rows per
expert, selected tokens first, ascending, then unselected ones as padding).

Bitwise equal to megatron's path in fp32 (forward and backward): the same gathers, the same
``scatter_add_`` (``index_add_`` under ``torch.use_deterministic_algorithms``) in the same row
order, the same ``zeros.index_add_`` that ``index_select``'s backward runs, the same dtype
promotion of ``tokens * probs`` and the same ``sum`` over hidden for the probs' gradient.
What differs is what autograd keeps: megatron's graph holds the routing map's ``.T``
copies, ``masked_select`` masks, the expanded index and, with probs, both factors of the
product; here each op saves its index vectors only (plus, for unpermute with probs that need a
gradient, the expert outputs and the gathered probs, which that gradient cannot do without).

Backends (``kernels.backend.backend_for``): portable (above), npu (torch_npu's
``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` for the dropless top-k case: every token
routed to the same number k of experts; other cases run portable), reference (megatron's
algorithm in plain differentiable torch ops, the oracle). The npu path's index is torch_npu's
int32 ``sorted_indices`` (row of each (token, k) pair); the portable path's is megatron's int64
token-per-row index: ``unpermute`` tells them apart by dtype.
"""

from __future__ import annotations

import torch

from mindspeed_like.kernels.backend import backend_for


def _selection(
    routing_map: torch.Tensor, num_out_tokens: int | None, drop_and_pad: bool, fixed_count: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token of each permuted row, its flat index ``expert * tokens + token`` into ``probs.T``).

    Dropless: the routing map's True entries in expert-major order (what megatron's
    ``masked_select`` on ``routing_map.T`` and its 0.19 ``argsort`` both produce). ``fixed_count``
    (megatron-core 0.19+'s algorithm, with ``num_out_tokens`` given): the first ``num_out_tokens``
    of a stable descending argsort of the flat map, a fixed-shape result that needs no
    device-to-host read (``nonzero`` does: one host round-trip a call on a GPU); the same rows
    wherever the map holds ``num_out_tokens`` True entries, as a dropless top-k map does.
    Drop-and-pad: megatron's stable descending argsort per expert, first ``capacity`` rows."""
    num_tokens, num_experts = routing_map.shape
    if drop_and_pad and num_out_tokens is not None:
        capacity = int(num_out_tokens) // num_experts
        per_expert = routing_map.to(torch.int8).T.contiguous().argsort(dim=-1, descending=True, stable=True)
        tokens = per_expert[:, :capacity].contiguous().view(-1)
        experts = torch.arange(num_experts, device=routing_map.device).repeat_interleave(capacity)
        return tokens, experts * num_tokens + tokens
    if fixed_count and num_out_tokens is not None:
        # a copy of the slice: the slice is a view of the whole experts x tokens argsort, which the
        # backward would keep alive (megatron 0.19's own permute does: 4x the indices at 8 experts)
        flat = routing_map.bool().T.contiguous().view(-1).argsort(descending=True, stable=True)[:num_out_tokens].clone()
        return flat % num_tokens, flat
    flat = routing_map.bool().T.contiguous().view(-1).nonzero().view(-1)
    if num_out_tokens is not None and 0 <= int(num_out_tokens) < flat.numel():
        flat = flat[: int(num_out_tokens)]
    return flat % num_tokens, flat


class _Permute(torch.autograd.Function):
    """Saves the two index vectors only."""

    @staticmethod
    def forward(ctx, tokens, probs, token_idx, flat_idx):
        ctx.save_for_backward(token_idx, flat_idx)
        ctx.tokens_shape = tokens.shape
        ctx.probs_shape = None if probs is None else probs.shape
        permuted = tokens.index_select(0, token_idx)
        permuted_probs = None
        if probs is not None:
            permuted_probs = probs.T.contiguous().view(-1).index_select(0, flat_idx)
        return permuted, permuted_probs

    @staticmethod
    def backward(ctx, grad_permuted, grad_probs):
        token_idx, flat_idx = ctx.saved_tensors
        grad_tokens = grad_in_probs = None
        if ctx.needs_input_grad[0]:
            # index_select's backward: zeros.index_add_ (rows of one token in permuted order)
            grad_tokens = grad_permuted.new_zeros(ctx.tokens_shape).index_add_(0, token_idx, grad_permuted)
        if ctx.probs_shape is not None and ctx.needs_input_grad[1] and grad_probs is not None:
            num_tokens, num_experts = ctx.probs_shape
            # unique positions: a copy, like masked_select's backward (keeps -0.0)
            flat = grad_probs.new_zeros(num_experts * num_tokens).index_copy_(0, flat_idx, grad_probs)
            grad_in_probs = flat.view(num_experts, num_tokens).T
        return grad_tokens, grad_in_probs, None, None


class _Unpermute(torch.autograd.Function):
    """Saves the index vectors; with probs also the gathered probs and, only when the probs need a
    gradient, the expert outputs."""

    @staticmethod
    def forward(ctx, permuted, probs, token_idx, flat_idx, restore_shape):
        ctx.input_dtype = permuted.dtype
        ctx.with_probs = probs is not None
        ctx.probs_shape = None if probs is None else probs.shape
        hidden = restore_shape[1]
        if probs is not None:
            permuted_probs = probs.T.contiguous().view(-1).index_select(0, flat_idx)
            weighted = permuted * permuted_probs.unsqueeze(-1)  # megatron's promotion
            keep_tokens = permuted if ctx.needs_input_grad[1] else None
            ctx.save_for_backward(token_idx, flat_idx, permuted_probs, keep_tokens)
        else:
            weighted = permuted
            ctx.save_for_backward(token_idx)
        ctx.work_dtype = weighted.dtype
        out = torch.zeros(restore_shape, dtype=weighted.dtype, device=weighted.device)
        if torch.are_deterministic_algorithms_enabled():
            out.index_add_(0, token_idx, weighted)
        else:
            out.scatter_add_(0, token_idx.unsqueeze(1).expand(-1, hidden), weighted)
        return out.to(ctx.input_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        grad_rows = grad_out.to(ctx.work_dtype).index_select(0, ctx.saved_tensors[0])
        if not ctx.with_probs:
            return grad_rows, None, None, None, None
        _, flat_idx, permuted_probs, permuted = ctx.saved_tensors
        grad_tokens = grad_probs = None
        if ctx.needs_input_grad[0]:
            grad_tokens = (grad_rows * permuted_probs.unsqueeze(-1)).to(ctx.input_dtype)
        if ctx.needs_input_grad[1]:
            per_row = (grad_rows * permuted).sum(-1, keepdim=True).view(-1).to(permuted_probs.dtype)
            num_tokens, num_experts = ctx.probs_shape
            flat = per_row.new_zeros(num_experts * num_tokens).index_copy_(0, flat_idx, per_row)
            grad_probs = flat.view(num_experts, num_tokens).T
        return grad_tokens, grad_probs, None, None, None


def _check(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None) -> None:
    if tokens.dim() != 2 or routing_map.dim() != 2 or routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"permute: tokens [tokens, hidden] and routing_map [tokens, experts] expected, got "
            f"{tuple(tokens.shape)} and {tuple(routing_map.shape)}"
        )
    if probs is not None and probs.shape != routing_map.shape:
        raise ValueError(
            f"permute: probs {tuple(probs.shape)} must have routing_map's shape {tuple(routing_map.shape)}"
        )


def permute(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    drop_and_pad: bool = False,
    fixed_count: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Rows of ``tokens`` grouped by expert: ``(permuted_tokens, permuted_probs, sorted_indices)``
    with megatron's ``moe_utils.permute`` semantics (``permuted_probs`` is None without probs).
    ``fixed_count``: megatron-core 0.19's dropless selection, sync-free (see :func:`_selection`)."""
    _check(tokens, routing_map, probs)
    backend = backend_for(tokens)
    if backend == "reference":
        return permute_reference(tokens, routing_map, probs, num_out_tokens, drop_and_pad)
    if backend == "npu":
        result = _permute_npu(tokens, routing_map, probs, num_out_tokens, drop_and_pad)
        if result is not None:
            return result
    token_idx, flat_idx = _selection(routing_map, num_out_tokens, drop_and_pad, fixed_count)
    permuted, permuted_probs = _Permute.apply(tokens, probs, token_idx, flat_idx)
    return permuted, permuted_probs, token_idx


def unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: torch.Size | tuple[int, int],
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    drop_and_pad: bool = False,
) -> torch.Tensor:
    """``permute``'s inverse: rows summed back into ``restore_shape`` (``[tokens, hidden]``),
    each weighted by its ``probs`` entry (``[tokens, experts]``, needs ``routing_map``) if given."""
    restore_shape = tuple(restore_shape)
    if probs is not None and routing_map is None:
        raise ValueError("unpermute: probs need the routing_map they were routed with")
    if sorted_indices.dtype == torch.int32:  # torch_npu's index, from the npu permute
        return _unpermute_npu(permuted_tokens, sorted_indices, restore_shape, probs, routing_map)
    if backend_for(permuted_tokens) == "reference":
        return unpermute_reference(permuted_tokens, sorted_indices, restore_shape, probs, routing_map, drop_and_pad)
    flat_idx = None
    if probs is not None:
        num_experts = routing_map.shape[1]
        if drop_and_pad:
            capacity = sorted_indices.numel() // num_experts
            experts = torch.arange(num_experts, device=sorted_indices.device).repeat_interleave(capacity)
            flat_idx = experts * probs.shape[0] + sorted_indices
        else:
            flat_idx = routing_map.bool().T.contiguous().view(-1).nonzero().view(-1)
    return _Unpermute.apply(permuted_tokens, probs, sorted_indices, flat_idx, restore_shape)


def permute_with_index(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Dropless ``permute`` (portable) that also returns each row's flat index
    ``expert * tokens + token``: what :func:`unpermute_with_index` needs to weight rows by probs
    without the routing map (TransformerEngine's ``moe_permute``/``moe_unpermute`` API)."""
    _check(tokens, routing_map, probs)
    token_idx, flat_idx = _selection(routing_map, num_out_tokens, False)
    permuted, permuted_probs = _Permute.apply(tokens, probs, token_idx, flat_idx)
    return permuted, permuted_probs, token_idx, flat_idx


def unpermute_with_index(
    permuted_tokens: torch.Tensor,
    token_idx: torch.Tensor,
    flat_idx: torch.Tensor,
    restore_shape: torch.Size | tuple[int, int],
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """``unpermute`` from :func:`permute_with_index`'s indices (portable)."""
    return _Unpermute.apply(
        permuted_tokens, probs, token_idx, flat_idx if probs is not None else None, tuple(restore_shape)
    )


def sort_chunks_by_idxs(
    input: torch.Tensor,
    split_sizes: torch.Tensor | list[int],
    sorted_idxs: torch.Tensor | list[int],
    probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunks of ``input`` (rows, sizes ``split_sizes``) reordered as ``sorted_idxs``: one
    ``index_select`` (a row gather, saved: the index) instead of split + cat of a list of views."""
    sizes = split_sizes.tolist() if isinstance(split_sizes, torch.Tensor) else list(split_sizes)
    order = sorted_idxs.tolist() if isinstance(sorted_idxs, torch.Tensor) else list(sorted_idxs)
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + int(size))
    if starts[-1] != input.shape[0] or sorted(order) != list(range(len(sizes))):
        raise ValueError(
            f"sort_chunks_by_idxs: split_sizes must cover the {input.shape[0]} rows (sum {starts[-1]}) and "
            f"sorted_idxs must be a permutation of the {len(sizes)} chunks, got {order}"
        )
    rows = [torch.arange(starts[i], starts[i + 1]) for i in order]
    index = (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)).to(input.device)
    out = _RowPermutation.apply(input, index)
    return out, (None if probs is None else _RowPermutation.apply(probs, index))


class _RowPermutation(torch.autograd.Function):
    """Rows gathered by a permutation; backward copies them back (megatron's split/cat
    backward is a copy too). Saves the index."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.shape = x.shape
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).index_copy_(0, index, grad), None


# ---------------------------------------------------------------------------------------------
# reference: megatron-core's unfused algorithm in plain torch ops (autograd through each op)


def permute_reference(
    tokens: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    drop_and_pad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    num_tokens, _ = tokens.shape
    num_experts = routing_map.shape[1]
    permuted_probs = None
    if drop_and_pad and num_out_tokens is not None:
        capacity = int(num_out_tokens) // num_experts
        sorted_indices = (
            routing_map.to(torch.int8).T.contiguous().argsort(dim=-1, descending=True, stable=True)[:, :capacity]
        )
        sorted_indices = sorted_indices.contiguous().view(-1)
        if probs is not None:
            rows = torch.arange(num_experts, device=routing_map.device).unsqueeze(-1)
            flat = (rows * num_tokens + sorted_indices.view(num_experts, capacity)).view(-1)
            permuted_probs = probs.T.contiguous().view(-1).index_select(0, flat)
    else:
        mask = routing_map.bool().T.contiguous()
        token_indices = torch.arange(num_tokens, device=routing_map.device).unsqueeze(0).expand(num_experts, -1)
        sorted_indices = token_indices.masked_select(mask)
        if probs is not None:
            permuted_probs = probs.T.contiguous().masked_select(mask)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute_reference(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: tuple[int, int],
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
    drop_and_pad: bool = False,
) -> torch.Tensor:
    input_dtype = permuted_tokens.dtype
    if probs is not None:
        num_experts = routing_map.shape[1]
        if drop_and_pad:
            capacity = sorted_indices.numel() // num_experts
            rows = torch.arange(num_experts, device=routing_map.device).unsqueeze(-1)
            flat = (rows * probs.shape[0] + sorted_indices.view(num_experts, capacity)).view(-1)
            permuted_probs = probs.T.contiguous().view(-1).index_select(0, flat)
        else:
            permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
        permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    out = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    out = out.index_add(0, sorted_indices, permuted_tokens)
    return out.to(input_dtype)


# ---------------------------------------------------------------------------------------------
# npu: torch_npu.npu_moe_token_permute / npu_moe_token_unpermute (notes/torch-npu-ops.md)


def _topk_indices(routing_map: torch.Tensor) -> torch.Tensor | None:
    """The experts of each token as ``[tokens, k]`` (ascending), or None when tokens differ in
    their number of experts (dropped tokens, a rank's local experts): the op needs one k."""
    counts = routing_map.sum(dim=1)
    k = int(counts[0]) if counts.numel() else 0
    if k == 0 or not bool((counts == k).all()):
        return None
    return routing_map.nonzero()[:, 1].view(-1, k)


def _permute_npu(tokens, routing_map, probs, num_out_tokens, drop_and_pad):
    if drop_and_pad:
        return None
    indices = _topk_indices(routing_map)
    if indices is None or indices.shape[1] > 512:
        return None
    total = indices.numel()
    if num_out_tokens is not None and int(num_out_tokens) != total:
        return None
    from mindspeed_like.kernels.backends.npu import torch_npu

    permuted, sorted_indices = torch_npu().npu_moe_token_permute(tokens, indices.to(torch.int32), num_out_tokens=total)
    permuted_probs = None
    if probs is not None:
        # sorted_indices[i] is the row of pair i = (token i // k, its (i % k)-th expert)
        pair_probs = probs.masked_select(routing_map.bool())
        permuted_probs = pair_probs.new_zeros(total).scatter(0, sorted_indices.long(), pair_probs)
    return permuted, permuted_probs, sorted_indices


def _unpermute_npu(permuted_tokens, sorted_indices, restore_shape, probs, routing_map):
    from mindspeed_like.kernels.backends.npu import torch_npu

    num_tokens = restore_shape[0]
    k = sorted_indices.numel() // num_tokens
    if probs is None:
        # the op sums the k rows of a token only through probs (without them topK is 1)
        weights = torch.ones(num_tokens, k, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    else:
        weights = probs.masked_select(routing_map.bool()).view(num_tokens, k).to(permuted_tokens.dtype)
    return torch_npu().npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=weights)


__all__ = [
    "permute",
    "permute_reference",
    "permute_with_index",
    "sort_chunks_by_idxs",
    "unpermute",
    "unpermute_reference",
    "unpermute_with_index",
]
