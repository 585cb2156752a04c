"""Emulators of ``torch_npu.npu_moe_token_permute`` and ``torch_npu.npu_moe_token_unpermute``.

Contracts (Ascend aclnnMoeTokenPermute / aclnnMoeTokenUnpermute docs, MindSpore's
moe_token_permute/unpermute API pages, MindSpeed's ops wrappers; see docs/features/moe-permute.md):

``npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False)
-> (permuted_tokens, sorted_indices)``
- tokens 2-D ``[num_tokens, hidden]``, fp16/bf16/fp32;
- indices int32/int64, ``[num_tokens, topk]`` or ``[num_tokens]`` (topk 1), values >= 0,
  topk <= 512, fewer than 2134372523 elements;
- num_out_tokens: None or 0 keeps every row; otherwise an int (the rows kept of the sorted
  order, the capacity-factor case);
- padded_mode must be False (documented as not supported);
- ``first = argsort(flatten(indices), stable)``, ``sorted_indices = argsort(first)`` (int32, one
  per (token, k) pair: the row it went to), ``permuted[sorted_indices[i]] = tokens[i // topk]``.

``npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
restore_shape=None) -> Tensor``
- permuted_tokens ``[num_tokens * topk, hidden]`` fp16/bf16/fp32; sorted_indices int32
  ``[num_tokens * topk]`` without duplicates; probs ``[num_tokens, topk]`` in permuted_tokens'
  dtype, topk <= 512 (None: topk is 1); padded_mode False;
- ``out[i] = sum_j permuted[sorted_indices[i * topk + j]] * probs[i, j]``, permuted_tokens' dtype.

Both are differentiable like the real ops (tokens; permuted_tokens and probs); the emulated
backward saves indices (and probs / permuted rows for the probs' gradient).
"""

from __future__ import annotations

import torch

from mindspeed_like.testing.npu_emulator import ContractError, register

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_TOPK = 512
_MAX_ELEMENTS = 2134372523


def _positional(name: str, names: tuple[str, ...], args: tuple, kwargs: dict) -> dict:
    if len(args) > len(names):
        raise ContractError(f"{name}{names} takes at most {len(names)} positional arguments, got {len(args)}")
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names:
            raise ContractError(f"{name}: unexpected keyword {key!r}; the signature is {names}")
        if key in bound:
            raise ContractError(f"{name}: {key} given both positionally and by keyword")
        bound[key] = value
    return bound


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, source_rows, rows):
        ctx.save_for_backward(source_rows, rows)
        ctx.shape = tokens.shape
        out = tokens.new_empty(rows.numel(), tokens.shape[1])
        out[rows] = tokens.index_select(0, source_rows)
        return out

    @staticmethod
    def backward(ctx, grad):
        source_rows, rows = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).index_add_(0, source_rows, grad[rows]), None, None


@register("npu_moe_token_permute")
def npu_moe_token_permute(*args, **kwargs):
    call = _positional("npu_moe_token_permute", ("tokens", "indices", "num_out_tokens", "padded_mode"), args, kwargs)
    tokens, indices = call.get("tokens"), call.get("indices")
    num_out_tokens, padded_mode = call.get("num_out_tokens"), call.get("padded_mode", False)
    if not isinstance(tokens, torch.Tensor) or not isinstance(indices, torch.Tensor):
        raise ContractError("npu_moe_token_permute: tokens and indices must be Tensors")
    if tokens.dim() != 2:
        raise ContractError(
            f"npu_moe_token_permute: tokens must be 2-D [num_tokens, hidden], got {tuple(tokens.shape)}"
        )
    if tokens.dtype not in _DTYPES:
        raise ContractError(f"npu_moe_token_permute: tokens dtype {tokens.dtype} unsupported (fp16/bf16/fp32)")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ContractError(f"npu_moe_token_permute: indices must be int32 or int64, got {indices.dtype}")
    if indices.dim() not in (1, 2) or indices.shape[0] != tokens.shape[0]:
        raise ContractError(
            f"npu_moe_token_permute: indices must be [num_tokens, topk] or [num_tokens] with num_tokens "
            f"{tokens.shape[0]}, got {tuple(indices.shape)}"
        )
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    if topk > _MAX_TOPK:
        raise ContractError(f"npu_moe_token_permute: topk {topk} > {_MAX_TOPK}")
    if indices.numel() >= _MAX_ELEMENTS or (indices.numel() and int(indices.min()) < 0):
        raise ContractError("npu_moe_token_permute: indices need non-negative values and < 2134372523 elements")
    if padded_mode is not False:
        raise ContractError("npu_moe_token_permute: padded_mode must be False (the padded mode is not supported)")
    if num_out_tokens is not None and (not isinstance(num_out_tokens, int) or isinstance(num_out_tokens, bool)):
        raise ContractError(f"npu_moe_token_permute: num_out_tokens must be an int or None, got {num_out_tokens!r}")
    first = torch.argsort(indices.reshape(-1), stable=True)
    sorted_indices = torch.argsort(first)
    kept = indices.numel() if not num_out_tokens else num_out_tokens
    kept = len(range(indices.numel())[:kept])  # a negative value slices like Python
    keep = sorted_indices < kept
    pairs = torch.arange(indices.numel(), device=indices.device)[keep]
    permuted = _Permute.apply(tokens, pairs // topk, sorted_indices[keep])
    return permuted, sorted_indices.to(torch.int32)


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, probs, sorted_indices, topk):
        rows = sorted_indices.long()
        gathered = permuted.index_select(0, rows).view(-1, topk, permuted.shape[1])
        ctx.save_for_backward(rows, probs, gathered if ctx.needs_input_grad[1] else None)
        ctx.shape = permuted.shape
        ctx.topk = topk
        if probs is None:
            return gathered.sum(1)
        return (gathered * probs.unsqueeze(-1)).sum(1)

    @staticmethod
    def backward(ctx, grad):
        rows, probs, gathered = ctx.saved_tensors
        per_pair = grad.unsqueeze(1).expand(-1, ctx.topk, -1)
        if probs is not None:
            per_pair = per_pair * probs.unsqueeze(-1)
        grad_permuted = grad.new_zeros(ctx.shape).index_add_(0, rows, per_pair.reshape(-1, ctx.shape[1]))
        grad_probs = None if gathered is None else (gathered * grad.unsqueeze(1)).sum(-1)
        return grad_permuted, grad_probs, None, None


@register("npu_moe_token_unpermute")
def npu_moe_token_unpermute(*args, **kwargs):
    call = _positional(
        "npu_moe_token_unpermute",
        ("permuted_tokens", "sorted_indices", "probs", "padded_mode", "restore_shape"),
        args,
        kwargs,
    )
    permuted, sorted_indices, probs = call.get("permuted_tokens"), call.get("sorted_indices"), call.get("probs")
    if call.get("padded_mode", False) is not False:
        raise ContractError("npu_moe_token_unpermute: padded_mode must be False (the padded mode is not supported)")
    if call.get("restore_shape") is not None:
        raise ContractError("npu_moe_token_unpermute: restore_shape is only read in the padded mode (unsupported)")
    if not isinstance(permuted, torch.Tensor) or permuted.dim() != 2:
        raise ContractError("npu_moe_token_unpermute: permuted_tokens must be a 2-D Tensor [num_tokens * topk, hidden]")
    if permuted.dtype not in _DTYPES:
        raise ContractError(f"npu_moe_token_unpermute: permuted_tokens dtype {permuted.dtype} unsupported")
    if not isinstance(sorted_indices, torch.Tensor) or sorted_indices.dtype != torch.int32:
        raise ContractError("npu_moe_token_unpermute: sorted_indices must be an int32 Tensor")
    if sorted_indices.dim() != 1 or sorted_indices.numel() != permuted.shape[0]:
        raise ContractError(
            f"npu_moe_token_unpermute: sorted_indices must be [num_tokens * topk] = [{permuted.shape[0]}], "
            f"got {tuple(sorted_indices.shape)}"
        )
    if sorted_indices.numel() and (
        int(sorted_indices.min()) < 0
        or int(sorted_indices.max()) >= permuted.shape[0]
        or torch.unique(sorted_indices).numel() != sorted_indices.numel()
    ):
        raise ContractError("npu_moe_token_unpermute: sorted_indices must be distinct rows of permuted_tokens")
    topk = 1
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or probs.dim() != 2:
            raise ContractError("npu_moe_token_unpermute: probs must be a 2-D Tensor [num_tokens, topk]")
        if probs.dtype != permuted.dtype:
            raise ContractError(
                f"npu_moe_token_unpermute: probs dtype {probs.dtype} must be permuted_tokens' {permuted.dtype}"
            )
        topk = probs.shape[1]
        if topk > _MAX_TOPK or probs.numel() != sorted_indices.numel():
            raise ContractError(
                f"npu_moe_token_unpermute: probs {tuple(probs.shape)} must hold one weight per row "
                f"({sorted_indices.numel()}) with topk <= {_MAX_TOPK}"
            )
    return _Unpermute.apply(permuted, probs, sorted_indices, topk)
