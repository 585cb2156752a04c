"""Emulator of ``torch_npu.npu_grouped_matmul`` (notes/torch-npu-ops.md), single-tensor MoE form.

    npu_grouped_matmul(x: list, weight: list, *, bias=None, group_list=None, split_item=0,
                       group_type=None, group_list_type=0) -> list

Contract enforced (``ContractError`` otherwise):
- ``x`` and ``weight`` are lists of one tensor each (the single-tensor MoE form), same dtype
  (fp32/fp16/bf16); ``bias`` None; everything after them by keyword.
- ``group_list``: a 1-D int64 tensor of at most 1024 groups. ``group_list_type=0``: the
  CUMULATIVE token counts (non-decreasing, last == the grouped dimension); ``1``: counts
  (non-negative, sum == the grouped dimension).
- ``group_type=0`` (group along M): x ``[M, K]``, weight ``[E, K, N]`` with E == groups,
  ``split_item`` 2 or 3 -> ``[y (M, N)]``.
- ``group_type=2`` (group along K, the weight gradient): x ``[K, M]``, weight ``[M, N]``
  grouped along M, ``split_item`` 3 -> ``[dW (E, K, N)]``.
- each tensor's last dimension < 65536.
Like the real op it has no autograd: results carry no grad_fn, so the caller must write the
backward (and a test that forgets to would see no gradients).
"""

from __future__ import annotations

import torch

from mindspeed_like.testing.npu_emulator import ContractError, register

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_KEYWORDS = {"bias", "group_list", "split_item", "group_type", "group_list_type"}
MAX_GROUPS = 1024
MAX_LAST_DIM = 65536


def _one_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, (list, tuple)) or len(value) != 1 or not isinstance(value[0], torch.Tensor):
        raise ContractError(f"npu_grouped_matmul: {name} must be a list of one tensor here, got {type(value).__name__}")
    return value[0]


def _counts(group_list, group_list_type: int, total: int) -> list[int]:
    if not isinstance(group_list, torch.Tensor) or group_list.dim() != 1 or group_list.dtype != torch.int64:
        raise ContractError("npu_grouped_matmul: group_list must be a 1-D int64 tensor")
    if not 1 <= group_list.numel() <= MAX_GROUPS:
        raise ContractError(f"npu_grouped_matmul: 1..{MAX_GROUPS} groups allowed, got {group_list.numel()}")
    values = [int(v) for v in group_list.tolist()]
    if group_list_type == 0:
        if any(b < a for a, b in zip([0, *values], values, strict=False)):
            raise ContractError(f"npu_grouped_matmul: group_list_type=0 needs a non-decreasing cumsum, got {values}")
        if values[-1] != total:
            raise ContractError(
                f"npu_grouped_matmul: cumulative group_list ends at {values[-1]}, the grouped dim is {total}"
            )
        return [b - a for a, b in zip([0, *values[:-1]], values, strict=True)]
    if group_list_type == 1:
        if any(v < 0 for v in values) or sum(values) != total:
            raise ContractError(f"npu_grouped_matmul: counts {values} must be >= 0 and sum to {total}")
        return values
    raise ContractError(f"npu_grouped_matmul: group_list_type must be 0 or 1, got {group_list_type!r}")


@register("npu_grouped_matmul")
def npu_grouped_matmul(*args, **kwargs) -> list[torch.Tensor]:
    if len(args) != 2:
        raise ContractError(f"npu_grouped_matmul: x and weight positionally, the rest by keyword; got {len(args)}")
    unknown = set(kwargs) - _KEYWORDS
    if unknown:
        raise ContractError(f"npu_grouped_matmul: unexpected keyword(s) {sorted(unknown)}")
    x, w = _one_tensor("x", args[0]), _one_tensor("weight", args[1])
    if kwargs.get("bias") is not None:
        raise ContractError("npu_grouped_matmul: bias is not used by this MoE form; pass bias=None")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ContractError(f"npu_grouped_matmul: x and weight must share fp32/fp16/bf16, got {x.dtype}, {w.dtype}")
    for t in (x, w):
        if t.shape[-1] >= MAX_LAST_DIM:
            raise ContractError(f"npu_grouped_matmul: last dim {t.shape[-1]} must be < {MAX_LAST_DIM}")
    group_type = kwargs.get("group_type")
    split_item = kwargs.get("split_item", 0)
    group_list_type = kwargs.get("group_list_type", 0)
    group_list = kwargs.get("group_list")
    with torch.no_grad():
        if group_type == 0:
            if x.dim() != 2 or w.dim() != 3 or w.shape[1] != x.shape[1]:
                raise ContractError(
                    f"npu_grouped_matmul group_type=0: x [M, K], weight [E, K, N]; got {tuple(x.shape)}, "
                    f"{tuple(w.shape)}"
                )
            if split_item not in (2, 3):
                raise ContractError(f"npu_grouped_matmul: one output needs split_item 2 or 3, got {split_item!r}")
            counts = _counts(group_list, group_list_type, x.shape[0])
            if len(counts) != w.shape[0]:
                raise ContractError(f"npu_grouped_matmul: {len(counts)} groups for {w.shape[0]} weights")
            out = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
            for e, rows in enumerate(torch.split(torch.arange(x.shape[0]), counts)):
                if rows.numel():
                    out[rows] = x[rows] @ w[e]
            return [out]
        if group_type == 2:
            if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
                raise ContractError(
                    f"npu_grouped_matmul group_type=2: x [K, M], weight [M, N]; got {tuple(x.shape)}, {tuple(w.shape)}"
                )
            if split_item != 3:
                raise ContractError(
                    f"npu_grouped_matmul group_type=2 returns one stacked tensor: split_item=3, got {split_item!r}"
                )
            counts = _counts(group_list, group_list_type, x.shape[1])
            out = torch.zeros(len(counts), x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
            start = 0
            for e, count in enumerate(counts):
                if count:
                    out[e] = x[:, start : start + count] @ w[start : start + count]
                start += count
            return [out]
    raise ContractError(f"npu_grouped_matmul: group_type must be 0 (along M) or 2 (along K) here, got {group_type!r}")
