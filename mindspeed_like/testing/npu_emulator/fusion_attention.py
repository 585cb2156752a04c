"""Emulator of ``torch_npu.npu_fusion_attention`` (notes/torch-npu-ops.md).

Contract enforced (ContractError otherwise):
- positional ``(query, key, value, head_num, input_layout)`` then only the documented keywords;
- layouts BSH, SBH, BSND, BNSD, TND; q, k, v one dtype (fp16/bf16/fp32) and rank; for BSH/SBH
  ``H = head_num * D`` (``head_num`` = QUERY heads) and the key/value head count divides
  ``head_num`` (GQA); head dim 1..768, ``Dq = Dk >= Dv``;
- ``scale`` a float, ``keep_prob`` in (0, 1], ``padding_mask`` None (unsupported);
- ``atten_mask`` bool or uint8, True = masked OUT; shapes BNSS / B1SS / 11SS / SS matching
  ``[Sq, Sk]`` for sparse modes 0 and 1; modes 2, 3 and 4 require exactly the compressed
  ``triu(ones(2048, 2048), 1)`` mask, so a mask of the wrong polarity or size fails;
- TND: ``actual_seq_qlen`` / ``actual_seq_kvlen`` lists of ints, cumulative end offsets
  WITHOUT a leading 0, non-decreasing, ending at T, as many for q as for kv.
Result: ``Dropout(Softmax(Mask(scale * Q K^T)), keep_prob) V`` in the input layout, plus the
documented extra outputs: fp32 softmax_max / softmax_sum ``[B, N, Sq, 8]`` (TND: ``[T, N, 8]``),
the row max of the masked scaled scores and the row sum of ``exp(score - max)``, the 8 entries
identical (a fully masked row: max -inf, sum 0, the emulator's choice: the hardware's is not
documented); an empty softmax_out, seed, offset, numels. Differentiable through plain autograd.
Sparse modes 5-8 (prefix, varlen outer split) and ``pse`` are not emulated (NotImplementedError).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindspeed_like.testing.npu_emulator import ContractError, register

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
KEYWORDS = (
    "pse",
    "padding_mask",
    "atten_mask",
    "scale",
    "keep_prob",
    "pre_tockens",
    "next_tockens",
    "inner_precise",
    "prefix",
    "actual_seq_qlen",
    "actual_seq_kvlen",
    "sparse_mode",
    "gen_mask_parallel",
    "sync",
)
_POSITIONAL = ("query", "key", "value", "head_num", "input_layout")
_COMPRESSED = 2048
_UNBOUNDED = 2147483647


def bind(op: str, positional: tuple, keywords: tuple, args: tuple, kwargs: dict) -> dict:
    """The call as a name -> value dict; only documented names, the positional ones required."""
    if len(args) > len(positional):
        raise ContractError(
            f"{op}: at most {len(positional)} positional arguments {positional}, the rest are keywords; got {len(args)}"
        )
    call = dict(zip(positional, args))
    for name, value in kwargs.items():
        if name not in positional and name not in keywords:
            raise ContractError(f"{op}: unexpected keyword {name!r}")
        if name in call:
            raise ContractError(f"{op}: {name} given twice")
        call[name] = value
    missing = [n for n in positional if n not in call]
    if missing:
        raise ContractError(f"{op}: missing {missing}")
    return call


def to_bnsd(x: torch.Tensor, layout: str, heads: int | None, name: str) -> torch.Tensor:
    """[B, N, S, D] view of one input; ``heads`` is needed for the H layouts."""
    if layout in ("BSH", "SBH"):
        if x.dim() != 3:
            raise ContractError(f"npu_fusion_attention: {name} must be 3-D for {layout}, got {tuple(x.shape)}")
        if x.shape[2] % heads:
            raise ContractError(f"npu_fusion_attention: {name} hidden {x.shape[2]} is not a multiple of {heads} heads")
        x = x if layout == "BSH" else x.transpose(0, 1)
        return x.reshape(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)
    if x.dim() != 4:
        raise ContractError(f"npu_fusion_attention: {name} must be 4-D for {layout}, got {tuple(x.shape)}")
    return x.transpose(1, 2) if layout == "BSND" else x


def from_bnsd(out: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = out.shape
    if layout == "BSH":
        return out.transpose(1, 2).reshape(b, s, n * d)
    if layout == "SBH":
        return out.permute(2, 0, 1, 3).reshape(s, b, n * d)
    if layout == "BSND":
        return out.transpose(1, 2)
    return out


def _check_mask(mask, mode: int, sq: int, sk: int, batch: int, heads: int) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype not in (torch.bool, torch.uint8):
        raise ContractError("npu_fusion_attention: atten_mask must be a bool or uint8 tensor (True/1 = masked out)")
    if mode in (2, 3, 4):
        if tuple(mask.shape) != (_COMPRESSED, _COMPRESSED):
            raise ContractError(
                f"npu_fusion_attention: sparse_mode {mode} takes the compressed {_COMPRESSED}x{_COMPRESSED} mask, "
                f"got {tuple(mask.shape)}"
            )
        expected = torch.triu(torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool, device=mask.device), 1)
        if not torch.equal(mask.bool(), expected):
            raise ContractError(
                f"npu_fusion_attention: sparse_mode {mode} needs triu(ones(2048, 2048), diagonal=1) "
                "(True = masked out above the diagonal); this mask differs (wrong polarity?)"
            )
        return
    shape = tuple(mask.shape)
    ok = shape == (sq, sk) or (
        len(shape) == 4 and shape[2:] == (sq, sk) and shape[0] in (1, batch) and shape[1] in (1, heads)
    )
    if not ok or (len(shape) == 4 and shape[0] == 1 and shape[1] == heads and heads != 1):
        raise ContractError(
            f"npu_fusion_attention: atten_mask shape {shape} is not BNSS/B1SS/11SS/SS for "
            f"B={batch}, N={heads}, Sq={sq}, Sk={sk}"
        )


def _masked_out(mask, mode: int, pre: int, nxt: int, sq: int, sk: int, device) -> torch.Tensor | None:
    """Boolean [.., sq, sk], True = masked out, for the documented sparse modes."""
    if mask is None:
        return None  # sparse_mode / pre / next are ignored without a mask
    rel = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]
    if mode == 0:  # band around the top-left diagonal plus the given mask
        return mask.bool() | (rel > nxt) | (rel < -pre)
    if mode == 1:
        return mask.bool()
    if mode == 2:
        return rel > 0
    if mode == 3:
        return rel > sk - sq
    if mode == 4:
        return (rel - (sk - sq) > nxt) | (rel - (sk - sq) < -pre)
    raise NotImplementedError(f"npu_fusion_attention emulator: sparse_mode {mode} is not emulated")


def masked_scores(q, k, masked, scale: float, op: str = "npu_fusion_attention") -> torch.Tensor:
    """fp32 ``scale * Q K^T`` with masked-out entries at -inf; GQA key heads repeated."""
    nq, nk = q.shape[1], k.shape[1]
    if nq % nk:
        raise ContractError(f"{op}: query heads {nq} not a multiple of key/value heads {nk}")
    scores = torch.matmul(q.float(), k.repeat_interleave(nq // nk, dim=1).float().transpose(-1, -2)) * scale
    return scores if masked is None else scores.masked_fill(masked, float("-inf"))


def _attention(q, k, v, masked, scale: float, keep_prob: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [B, N, Sq, Dv] in q's dtype, row max [B, N, Sq], row sum [B, N, Sq]) (both fp32)."""
    scores = masked_scores(q, k, masked, scale)
    if scores.shape[-1] == 0:  # no keys (an empty packed sequence): nothing seen
        row_max = torch.full(scores.shape[:-1], float("-inf"), device=scores.device)
    else:
        row_max = scores.amax(dim=-1)
    row_sum = torch.exp(scores - row_max.unsqueeze(-1)).sum(dim=-1).nan_to_num(0.0)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if keep_prob < 1.0:
        probs = torch.nn.functional.dropout(probs, 1.0 - keep_prob)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.matmul(probs, v.float()).to(q.dtype), row_max, row_sum


def widen(stat: torch.Tensor) -> torch.Tensor:
    """A per-row fp32 statistic as torch_npu returns it: 8 identical entries in a last dim."""
    return stat.float().unsqueeze(-1).expand(*stat.shape, 8).contiguous()


def _cumulative(name: str, value, total: int) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ContractError(f"npu_fusion_attention: {name} must be a list of ints for TND, got {value!r}")
    if not value or value[0] <= 0:
        raise ContractError(
            f"npu_fusion_attention: {name} are cumulative end offsets WITHOUT a leading 0 (lengths 2,2 -> [2, 4]); "
            f"got {list(value)}"
        )
    if any(b < a for a, b in zip(value, value[1:])) or value[-1] != total:
        raise ContractError(f"npu_fusion_attention: {name} {list(value)} must be non-decreasing and end at T={total}")
    return [0, *value]


def _outputs(out: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor) -> tuple:
    empty = torch.empty(0, dtype=out.dtype, device=out.device)
    return out, widen(row_max.detach()), widen(row_sum.detach()), empty, 0, 0, 0


@dataclass
class Checked:
    """A call past the contract checks the forward and its grad share."""

    layout: str
    heads: int
    scale: float
    keep_prob: float
    mode: int
    pre: int
    nxt: int
    mask: torch.Tensor | None


def check_common(op: str, call: dict, scale_key: str) -> Checked:
    q, k, v = call["query"], call["key"], call["value"]
    heads, layout = call["head_num"], call["input_layout"]
    if layout not in _LAYOUTS:
        raise ContractError(f"{op}: input_layout {layout!r} is not one of {_LAYOUTS}")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
        raise ContractError(f"{op}: head_num must be a positive int, got {heads!r}")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise ContractError(f"{op}: query, key, value must be tensors")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ContractError(f"{op}: q/k/v dtypes {q.dtype}, {k.dtype}, {v.dtype}: one of fp16/bf16/fp32")
    if not (q.dim() == k.dim() == v.dim()):
        raise ContractError(f"{op}: q, k, v must share one layout")
    scale, keep_prob = call.get(scale_key, 1.0), call.get("keep_prob", 1.0)
    if not isinstance(scale, float):
        raise ContractError(f"{op}: {scale_key} must be a float, got {scale!r}")
    if not isinstance(keep_prob, float) or not 0.0 < keep_prob <= 1.0:
        raise ContractError(f"{op}: keep_prob must be a float in (0, 1], got {keep_prob!r}")
    if call.get("padding_mask") is not None:
        raise ContractError(f"{op}: padding_mask is not supported")
    if call.get("pse") is not None or call.get("prefix") is not None:
        raise NotImplementedError(f"{op} emulator: pse / prefix are not emulated")
    mode = call.get("sparse_mode", 0)
    if not isinstance(mode, int) or not 0 <= mode <= 8:
        raise ContractError(f"{op}: sparse_mode must be an int 0..8, got {mode!r}")
    pre, nxt = call.get("pre_tockens", _UNBOUNDED), call.get("next_tockens", _UNBOUNDED)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (pre, nxt)):
        raise ContractError(f"{op}: pre_tockens / next_tockens must be ints")
    return Checked(layout, heads, scale, keep_prob, mode, pre, nxt, call.get("atten_mask"))


def dense_inputs(op: str, call: dict, checked: Checked):
    """(q, k, v as [B, N, S, D], the masked-out matrix or None) of a non-TND call."""
    q, k, v, layout, heads = call["query"], call["key"], call["value"], checked.layout, checked.heads
    if call.get("actual_seq_qlen") is not None or call.get("actual_seq_kvlen") is not None:
        raise ContractError(f"{op}: actual_seq_qlen/kvlen are for the TND layout only")
    qb = to_bnsd(q, layout, heads, "query")
    if qb.shape[1] != heads:
        raise ContractError(f"{op}: head_num {heads} but query has {qb.shape[1]} heads")
    d = qb.shape[-1]
    if not 1 <= d <= 768:
        raise ContractError(f"{op}: head dim {d} outside 1..768")
    kv_heads = None
    if layout in ("BSH", "SBH"):
        if k.shape[2] % d or v.shape[2] % d:
            raise ContractError(f"{op}: key/value hidden {k.shape[2]}/{v.shape[2]} not a multiple of D={d}")
        kv_heads = k.shape[2] // d
    kb, vb = to_bnsd(k, layout, kv_heads, "key"), to_bnsd(v, layout, kv_heads, "value")
    if kb.shape[-1] != d or vb.shape[-1] > d or kb.shape[:3] != vb.shape[:3] or kb.shape[0] != qb.shape[0]:
        raise ContractError(f"{op}: key {tuple(k.shape)} / value {tuple(v.shape)} do not fit query")
    sq, sk = qb.shape[2], kb.shape[2]
    _check_mask(checked.mask, checked.mode, sq, sk, qb.shape[0], heads)
    masked = _masked_out(checked.mask, checked.mode, checked.pre, checked.nxt, sq, sk, q.device)
    return qb, kb, vb, masked


@register("npu_fusion_attention")
def npu_fusion_attention(*args, **kwargs) -> tuple:
    op = "npu_fusion_attention"
    call = bind(op, _POSITIONAL, KEYWORDS, args, kwargs)
    c = check_common(op, call, "scale")
    if c.layout == "TND":
        return _tnd(
            call["query"], call["key"], call["value"], c.heads, c.mask, c.mode, c.pre, c.nxt, c.scale, c.keep_prob, call
        )
    qb, kb, vb, masked = dense_inputs(op, call, c)
    out, row_max, row_sum = _attention(qb, kb, vb, masked, c.scale, c.keep_prob)
    return _outputs(from_bnsd(out, c.layout), row_max, row_sum)


def _tnd(q, k, v, heads, mask, mode, pre, nxt, scale, keep_prob, call) -> tuple:
    if q.dim() != 3:
        raise ContractError(f"npu_fusion_attention: TND input must be 3-D [T, N, D], got {tuple(q.shape)}")
    if q.shape[1] != heads:
        raise ContractError(f"npu_fusion_attention: head_num {heads} but query has {q.shape[1]} heads")
    cu_q = _cumulative("actual_seq_qlen", call.get("actual_seq_qlen"), q.shape[0])
    cu_kv = _cumulative("actual_seq_kvlen", call.get("actual_seq_kvlen"), k.shape[0])
    if len(cu_q) != len(cu_kv):
        raise ContractError("npu_fusion_attention: actual_seq_qlen and actual_seq_kvlen differ in length")
    if mode not in (0, 2, 3, 4) and mask is not None:
        raise NotImplementedError(f"npu_fusion_attention emulator: TND with sparse_mode {mode} is not emulated")
    if mask is not None and mode == 0:
        raise NotImplementedError("npu_fusion_attention emulator: TND with an explicit mask is not emulated")
    _check_mask(mask, mode, 0, 0, 1, heads)
    outs, maxes, sums = [], [], []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1).unsqueeze(0)
        ki = k[cu_kv[i] : cu_kv[i + 1]].transpose(0, 1).unsqueeze(0)
        vi = v[cu_kv[i] : cu_kv[i + 1]].transpose(0, 1).unsqueeze(0)
        masked = _masked_out(mask, mode, pre, nxt, qi.shape[2], ki.shape[2], q.device)
        out, row_max, row_sum = _attention(qi, ki, vi, masked, scale, keep_prob)
        outs.append(out[0].transpose(0, 1))
        maxes.append(row_max[0].transpose(0, 1))  # [Ti, N]
        sums.append(row_sum[0].transpose(0, 1))
    return _outputs(torch.cat(outs, dim=0), torch.cat(maxes, dim=0), torch.cat(sums, dim=0))
