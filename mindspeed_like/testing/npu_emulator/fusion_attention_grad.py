"""Emulator of ``torch_npu.npu_fusion_attention_grad`` (notes/torch-npu-ops.md).

The backward of ``npu_fusion_attention`` as a callable op: context-parallel code calls it with a
block's q/k/v and the MERGED forward results (``softmax_max``, ``softmax_sum``, ``attention_in``)
to get that block's exact share of the gradient. Contract enforced (ContractError otherwise):
- positional ``(query, key, value, dy, head_num, input_layout)``, then only the documented
  keywords; the scale keyword is ``scale_value`` here (``scale`` in the forward);
- the forward's checks on q/k/v, layout, mask and sparse mode (shared with the forward emulator);
- ``softmax_max`` / ``softmax_sum`` fp32 ``[B, N, Sq, 8]`` and ``attention_in`` (the forward's
  output, q's dtype and layout) given, ``dy`` shaped like ``attention_in``.
Result ``(dq, dk, dv, dpse)``: with ``P = exp(S - softmax_max) / softmax_sum`` on the masked scaled
scores ``S`` and ``D = rowsum(dy * attention_in)``: ``dV = P^T dy``, ``dS = P (dy V^T - D)``,
``dQ = scale dS K``, ``dK = scale dS^T Q`` (GQA: summed over each group's heads), in the input
layout and dtype; ``dpse`` empty. Dropout (keep_prob < 1: the mask is regenerated from seed and
offset on the device) and the TND layout are not emulated (NotImplementedError).
"""

from __future__ import annotations

import torch

from mindspeed_like.testing.npu_emulator import ContractError, register
from mindspeed_like.testing.npu_emulator.fusion_attention import (
    KEYWORDS as FORWARD_KEYWORDS,
)
from mindspeed_like.testing.npu_emulator.fusion_attention import (
    bind,
    check_common,
    dense_inputs,
    from_bnsd,
    masked_scores,
    to_bnsd,
)

_OP = "npu_fusion_attention_grad"
_POSITIONAL = ("query", "key", "value", "dy", "head_num", "input_layout")
# the forward's keywords (``scale`` renamed ``scale_value``) and the forward's results
_KEYWORDS = (
    *(name for name in FORWARD_KEYWORDS if name != "scale"),
    "softmax_max",
    "softmax_sum",
    "softmax_in",
    "attention_in",
    "scale_value",
    "seed",
    "offset",
    "numels",
)


def _stat(call: dict, name: str, shape: tuple) -> torch.Tensor:
    stat = call.get(name)
    if not isinstance(stat, torch.Tensor):
        raise ContractError(f"{_OP}: {name} (the forward's output) must be given as a tensor")
    if stat.dtype != torch.float32 or tuple(stat.shape) != shape:
        raise ContractError(
            f"{_OP}: {name} must be fp32 {list(shape)} ([B, N, Sq, 8]), got {stat.dtype} {list(stat.shape)}"
        )
    return stat[..., 0]


@register(_OP)
def npu_fusion_attention_grad(*args, **kwargs) -> tuple:
    call = bind(_OP, _POSITIONAL, _KEYWORDS, args, kwargs)
    checked = check_common(_OP, call, "scale_value")
    if checked.layout == "TND":
        raise NotImplementedError(f"{_OP} emulator: the TND layout is not emulated")
    if checked.keep_prob < 1.0:
        raise NotImplementedError(f"{_OP} emulator: dropout (keep_prob < 1) is not emulated")
    q, k, v = call["query"], call["key"], call["value"]
    qb, kb, vb, masked = dense_inputs(_OP, call, checked)
    b, n, sq, _ = qb.shape
    row_max = _stat(call, "softmax_max", (b, n, sq, 8))
    row_sum = _stat(call, "softmax_sum", (b, n, sq, 8))
    out, dy = call.get("attention_in"), call["dy"]
    if not isinstance(out, torch.Tensor) or out.dtype != q.dtype:
        raise ContractError(f"{_OP}: attention_in (the forward's output, {q.dtype}) must be given")
    if not isinstance(dy, torch.Tensor) or dy.shape != out.shape or dy.dtype != q.dtype:
        raise ContractError(
            f"{_OP}: dy {getattr(dy, 'dtype', None)} {list(getattr(dy, 'shape', []))} must match attention_in "
            f"{out.dtype} {list(out.shape)}"
        )
    out_b, dy_b = (to_bnsd(t, checked.layout, n, name).float() for t, name in ((out, "attention_in"), (dy, "dy")))
    scores = masked_scores(qb, kb, masked, checked.scale, _OP)
    probs = torch.exp(scores - row_max.unsqueeze(-1)) / row_sum.unsqueeze(-1)
    probs = probs.nan_to_num(0.0)
    rep = n // kb.shape[1]
    k_full, v_full = kb.float().repeat_interleave(rep, 1), vb.float().repeat_interleave(rep, 1)
    delta = (dy_b * out_b).sum(-1, keepdim=True)
    dscores = probs * (torch.matmul(dy_b, v_full.transpose(-1, -2)) - delta)
    dq = torch.matmul(dscores, k_full) * checked.scale
    dk = torch.matmul(dscores.transpose(-1, -2), qb.float()) * checked.scale
    dv = torch.matmul(probs.transpose(-1, -2), dy_b)
    groups = kb.shape[1]
    dk = dk.view(b, groups, rep, *dk.shape[2:]).sum(2)
    dv = dv.view(b, groups, rep, *dv.shape[2:]).sum(2)
    results = (from_bnsd(g.to(t.dtype), checked.layout) for g, t in ((dq, q), (dk, k), (dv, v)))
    return (*results, torch.empty(0, dtype=q.dtype, device=q.device))
