"""Emulator of ``npu_ring_attention_update`` (notes/torch-npu-ops.md): the exact merge of two
partial attention results by their softmax max and sum, as ring attention needs it.

Contract enforced (ContractError otherwise):
- ``(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max,
  cur_softmax_sum, actual_seq_qlen=None, layout="SBH")``;
- outputs one dtype (fp16/bf16/fp32) and shape: ``[S, B, H]`` (SBH) or ``[T, N, D]`` (TND);
- max/sum fp32 ``[B, N, S, 8]`` (SBH, ``H`` a multiple of ``N``) or ``[T, N, 8]`` (TND);
- TND: ``actual_seq_qlen`` given (cumulative from 0, non-decreasing, ending at T), ``D`` a
  multiple of 64 and the documented on-chip bound
  ``AlignUp(N*D, 64)*(bytes*6+8) + AlignUp(N*8, 64)*56 <= 192*1024``.
Result ``(attn_out, softmax_max, softmax_sum)``: ``m = max(m1, m2)``,
``s = s1 exp(m1-m) + s2 exp(m2-m)``, ``out = (out1 s1 exp(m1-m) + out2 s2 exp(m2-m)) / s``.
A side whose max is -inf (nothing seen yet) contributes nothing.
"""

from __future__ import annotations

import torch

from mindspeed_like.testing.npu_emulator import ContractError, register
from mindspeed_like.testing.npu_emulator.fusion_attention import widen

_OP = "npu_ring_attention_update"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _align(x: int, to: int = 64) -> int:
    return (x + to - 1) // to * to


def _check_tnd(out: torch.Tensor, stat_shape: tuple, cu) -> None:
    t, n, d = out.shape
    if stat_shape != (t, n, 8):
        raise ContractError(f"{_OP}: TND softmax_max/sum must be [T, N, 8] = {[t, n, 8]}, got {list(stat_shape)}")
    if d % 64:
        raise ContractError(f"{_OP}: TND needs the head dim D a multiple of 64, got {d}")
    size = 4 if out.dtype == torch.float32 else 2
    if _align(n * d) * (size * 6 + 8) + _align(n * 8) * 56 > 192 * 1024:
        raise ContractError(f"{_OP}: TND with N={n}, D={d} exceeds the documented on-chip bound")
    if cu is None:
        raise ContractError(f"{_OP}: TND needs actual_seq_qlen")
    values = cu.tolist() if isinstance(cu, torch.Tensor) else list(cu)
    if not values or values[0] != 0 or values[-1] != t or any(b < a for a, b in zip(values, values[1:])):
        raise ContractError(f"{_OP}: actual_seq_qlen must be non-decreasing from 0 to T={t}, got {values}")


@register(_OP)
def npu_ring_attention_update(
    prev_attn_out,
    prev_softmax_max,
    prev_softmax_sum,
    cur_attn_out,
    cur_softmax_max,
    cur_softmax_sum,
    actual_seq_qlen=None,
    layout: str = "SBH",
) -> tuple:
    outs, stats = (prev_attn_out, cur_attn_out), (prev_softmax_max, prev_softmax_sum, cur_softmax_max, cur_softmax_sum)
    if not all(isinstance(t, torch.Tensor) for t in (*outs, *stats)):
        raise ContractError(f"{_OP}: the six inputs must be tensors")
    if prev_attn_out.dtype not in _DTYPES or cur_attn_out.dtype != prev_attn_out.dtype:
        raise ContractError(
            f"{_OP}: attention outputs {prev_attn_out.dtype}/{cur_attn_out.dtype} must share one of fp16/bf16/fp32"
        )
    if prev_attn_out.shape != cur_attn_out.shape or prev_attn_out.dim() != 3:
        raise ContractError(
            f"{_OP}: attention outputs must share one 3-D shape, got {list(prev_attn_out.shape)} / "
            f"{list(cur_attn_out.shape)}"
        )
    shape = tuple(prev_softmax_max.shape)
    if any(t.dtype != torch.float32 or tuple(t.shape) != shape for t in stats):
        raise ContractError(f"{_OP}: softmax_max/sum must all be fp32 of one shape")
    if layout == "SBH":
        s, b, h = prev_attn_out.shape
        if len(shape) != 4 or shape[0] != b or shape[2] != s or shape[3] != 8 or h % shape[1]:
            raise ContractError(
                f"{_OP}: SBH softmax_max/sum must be [B, N, S, 8] with H a multiple of N for out [S, B, H] = "
                f"{[s, b, h]}, got {list(shape)}"
            )
        if actual_seq_qlen is not None:
            raise ContractError(f"{_OP}: actual_seq_qlen is for the TND layout only")
    elif layout == "TND":
        _check_tnd(prev_attn_out, shape, actual_seq_qlen)
    else:
        raise ContractError(f"{_OP}: layout must be 'SBH' or 'TND', got {layout!r}")
    m1, s1, m2, s2 = (t[..., 0] for t in stats)
    m = torch.maximum(m1, m2)
    w1 = torch.where(m1 == float("-inf"), 0.0, s1 * torch.exp(m1 - m))
    w2 = torch.where(m2 == float("-inf"), 0.0, s2 * torch.exp(m2 - m))
    total = w1 + w2
    if layout == "SBH":  # [B, N, S] weights onto [S, B, N*D]
        n = shape[1]
        s, b, h = prev_attn_out.shape

        def spread(w):
            return w.permute(2, 0, 1).unsqueeze(-1).expand(s, b, n, h // n).reshape(s, b, h)
    else:  # [T, N] weights onto [T, N, D]

        def spread(w):
            return w.unsqueeze(-1)

    out = (prev_attn_out.float() * spread(w1) + cur_attn_out.float() * spread(w2)) / spread(total)
    return out.to(prev_attn_out.dtype), widen(m), widen(total)
