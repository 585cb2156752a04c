"""Core attention without the ``[b, heads, sq, sk]`` score/probability matrices.

megatron-core's local ``DotProductAttention`` computes ``softmax(mask(scale * q k^T)) v`` with
two batched matmuls and keeps the scores and probabilities (O(s^2) per head) for backward.
This op takes megatron's layouts and semantics and computes the same result with a
flash-style kernel:

- ``npu``: ``torch_npu.npu_fusion_attention`` (contract in notes/torch-npu-ops.md): layout SBH
  for ``[s, b, n, d]`` input and TND for packed sequences; causal attention as sparse_mode 2
  (top-left) / 3 (bottom-right) with the compressed 2048x2048 mask; a bottom-right band
  (sliding window) as sparse_mode 4; an explicit mask as sparse_mode 1 with ``True`` = masked
  out; ``scale`` passed explicitly; ``keep_prob = 1 - dropout``; ``head_num`` = query heads.
- ``portable``: ``torch.nn.functional.scaled_dot_product_attention``. Its CPU and CUDA flash
  kernels never hold the s x s matrix. Causal masks go in as ``is_causal`` (never materialized);
  a boolean mask (SDPA: ``True`` = keep, the opposite of megatron's) only when the caller gives
  one or asks for a band SDPA cannot express. GQA with ``enable_gqa`` (k/v are expanded as
  views, not copied). Dropout > 0 on CPU, which PyTorch's CPU flash kernel does not take (its math
  kernel would keep three fp32 s x s tensors and an fp32 copy of q, k, v per head), runs
  ``kernels/blocked_attention.py`` instead: flash-style, its masks drawn again in backward. A value
  head dim different from q/k's (multi-latent attention) is refused by the CPU flash kernel: on
  CPU the smaller operand is zero-padded for it (``_one_head_dim``: 1.2-3x faster than the
  unpadded alternative), or with ``pad_value_head=False`` (``--mla-fa-without-pad``) the calls
  run ``kernels/blocked_attention.py`` (flash-style, V not padded).
- ``reference``: megatron's eager math (``masked_fill(-10000)``, softmax, dropout, matmul),
  the oracle of the tests.

Masks are described by megatron's conventions: ``mask`` is boolean with ``True`` = masked out
(broadcastable to ``[b, n, sq, sk]``), and a :class:`Band` restricts which keys each query sees
(causal is the band ``left=None, right=0``). A query row whose keys are ALL masked gets
megatron's result, the mean of ``v`` over every key (megatron fills masked scores with -10000,
so its softmax is uniform there; flash kernels would return 0 or NaN): such rows are unmasked
for the kernel call and their output replaced, which also gives megatron's gradients (none to
q and k, ``1/sk`` of the row's gradient to each v).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mindspeed_like.kernels.backend import backend_for
from mindspeed_like.kernels.backends.npu import torch_npu
from mindspeed_like.kernels.blocked_attention import blocked_attention

NPU_COMPRESSED_MASK_SIZE = 2048  # sparse modes 2, 3, 4 take this fixed mask whatever the lengths
NPU_UNBOUNDED = 2147483647  # torch_npu's default pre/next_tockens: no band
MEGATRON_MASK_FILL = -10000.0  # megatron.core.transformer.utils.attention_mask_func


@dataclass(frozen=True)
class Band:
    """Query ``i`` sees key ``j`` iff ``-left <= j - i - offset <= right`` (None = unbounded).

    ``offset`` is 0 when anchored top-left and ``sk - sq`` when anchored bottom-right (the last
    query sees the last key). Causal = ``Band(None, 0, ...)``; megatron's sliding window
    ``window_size=(left, right)`` = ``Band(left, right, bottom_right=True)``.
    """

    left: int | None
    right: int | None
    bottom_right: bool = True

    @property
    def is_causal(self) -> bool:
        return self.left is None and self.right == 0

    def offset(self, sq: int, sk: int) -> int:
        return sk - sq if self.bottom_right else 0

    def keep(self, sq: int, sk: int, device: torch.device) -> torch.Tensor:
        """The band as a boolean ``[sq, sk]`` matrix, True = keep (SDPA's polarity)."""
        rel = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]
        rel = rel - self.offset(sq, sk)
        keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if self.left is not None:
            keep &= rel >= -self.left
        if self.right is not None:
            keep &= rel <= self.right
        return keep

    def normalized(self, sq: int, sk: int) -> Band:
        """The same band with sides that never bind for these lengths set to None (unbounded),
        so e.g. MindSpeed's default ``pre_tockens=65536`` is recognised as plain causal."""
        off = self.offset(sq, sk)
        left = None if self.left is None or sq - 1 + off <= self.left else self.left
        right = None if self.right is None or sk - 1 - off <= self.right else self.right
        return Band(left, right, self.bottom_right)

    def is_full(self, sq: int, sk: int) -> bool:
        """True when the band keeps every key of every query (nothing to apply)."""
        off = self.offset(sq, sk)
        left_ok = self.left is None or (sq - 1) - 0 + off <= self.left  # j=0, i=sq-1: rel = -(sq-1) - off
        right_ok = self.right is None or (sk - 1) - off <= self.right  # j=sk-1, i=0
        return left_ok and right_ok


CAUSAL = Band(None, 0, bottom_right=True)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads_dim: int) -> None:
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    nq, nk = q.shape[heads_dim], k.shape[heads_dim]
    if nk != v.shape[heads_dim] or nq % nk != 0:
        raise ValueError(
            f"flash_attention: query heads ({nq}) must be a multiple of key/value heads ({nk}, {v.shape[heads_dim]})"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"flash_attention: query and key head dims differ ({q.shape[-1]}, {k.shape[-1]})")


# ---------------------------------------------------------------- mask preparation (all backends)


def _explicit_keep(
    mask: torch.Tensor | None, band: Band | None, sq: int, sk: int, device: torch.device, native_band: bool
) -> torch.Tensor | None:
    """The boolean keep-mask (True = keep) when one must be materialized, else None.

    ``native_band``: the backend expresses ``band`` without a mask (then it is left out here
    unless a caller mask must be combined with it).
    """
    keep = None if mask is None else ~mask.to(device=device, dtype=torch.bool)
    if band is not None and not band.is_full(sq, sk) and (keep is not None or not native_band):
        band_keep = band.keep(sq, sk, device)
        keep = band_keep if keep is None else keep & band_keep
    return keep


def _empty_rows(keep: torch.Tensor) -> torch.Tensor | None:
    """Rows of ``keep`` (``[..., sq, sk]``) that keep no key, as ``[..., sq, 1]``, or None."""
    empty = ~keep.any(dim=-1, keepdim=True)
    return empty if bool(empty.any()) else None


def _uniform_rows(v_bnsd: torch.Tensor, nq: int) -> torch.Tensor:
    """megatron's output for a fully masked row: mean of v over all keys, per query head."""
    mean = v_bnsd.mean(dim=2, keepdim=True)  # [b, nk, 1, d]
    return mean.repeat_interleave(nq // v_bnsd.shape[1], dim=1) if mean.shape[1] != nq else mean


# ---------------------------------------------------------------- portable (SDPA)


def _cpu_flash_refuses(q: torch.Tensor, v: torch.Tensor) -> bool:
    """PyTorch's CPU flash kernel needs one head dim for q, k and v; with a different V head dim
    (multi-latent attention) SDPA would run its math kernel and save the s x s probabilities.
    On CUDA, SDPA's memory-efficient kernel takes a different V head dim itself."""
    return q.device.type == "cpu" and q.shape[-1] != v.shape[-1]


def _one_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v zero-padded to one head dim for the CPU flash kernel (the caller slices the output
    back to V's). Zeros add nothing to q.k (the scale is the caller's, explicit) nor to P.V's kept
    columns, so the result is the unpadded attention's; the price is a padded copy of the smaller
    operand and max(d)/d_v times the P.V work. Measured on this 2-core CPU (bf16, 8 heads, d_qk 48,
    d_v 32, causal, forward+backward): seq 256 13.5 ms padded vs 15.8 ms for the unpadded blocked
    kernel, seq 1024 51 vs 125-168 ms; megatron's unfused math 14 / 155 ms."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        return q, k, F.pad(v, (0, d - dv))
    return F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d)), v


def _nan_query_rows(q: torch.Tensor) -> torch.Tensor:
    """``[b, n, s, 1]``: NaN where the query row holds a NaN, else 0; added to SDPA's output.

    megatron's scores of such a row are NaN at every key, so its softmax and output row are NaN
    (and its loss, and megatron's NaN guard stops the run). Torch's CPU flash kernel returns a
    row of zeros there instead (its running max skips NaN): a NaN reaching attention vanished.
    Detached: the gradient reaching SDPA is unchanged; one pass over q and one add."""
    with torch.no_grad():
        finite = ~torch.isnan(q).any(dim=-1, keepdim=True)
        return torch.where(finite, 0.0, float("nan")).to(q.dtype)


def _portable_bnsd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    band: Band | None,
    dropout_p: float,
    pad_value_head: bool = True,
) -> torch.Tensor:
    """SDPA on ``[b, n, s, d]`` views; returns ``[b, nq, sq, dv]``. A V head dim different from
    q/k's on CPU: padded for the fused kernel (``pad_value_head``, the default), else the unpadded
    blocked kernel (:func:`~mindspeed_like.kernels.blocked_attention.blocked_attention`)."""
    nq, nk, sq, sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    band = None if band is None else band.normalized(sq, sk)
    # SDPA's is_causal is top-left; it equals bottom-right when sq == sk.
    native = band is not None and band.is_causal and (sq == sk or not band.bottom_right)
    keep = _explicit_keep(mask, band, sq, sk, q.device, native_band=native)
    is_causal = native and keep is None and not band.is_full(sq, sk)
    empty = None if keep is None else _empty_rows(keep)
    if empty is not None:
        keep = keep | empty  # give the kernel a valid row; its output is replaced below
    refused = _cpu_flash_refuses(q, v)
    host_dropout = q.device.type == "cpu" and dropout_p > 0.0
    if host_dropout or (refused and not pad_value_head):
        # torch's CPU flash kernel takes no dropout (SDPA would run its math kernel, keeping three
        # fp32 s x s tensors): the blocked kernel draws the masks per block; it also takes MLA's
        # two head dims unpadded
        out = blocked_attention(q, k, v, scale=scale, keep=keep, causal=is_causal, dropout_p=dropout_p)
    else:
        dv = v.shape[-1]
        qp, kp, vp = _one_head_dim(q, k, v) if refused and pad_value_head else (q, k, v)
        out = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=nq != nk
        )
        out = out[..., :dv] if out.shape[-1] != dv else out
        if q.device.type != "cpu" or torch.isnan(q).any():
            # On a host the check is free and the rare NaN case alone pays for the add (a new tensor:
            # the output projection then saves it beside SDPA's own saved output, one more copy a
            # layer); on an accelerator the check would be a host sync per layer, so the add runs.
            out = out + _nan_query_rows(q)
    if empty is not None:
        out = torch.where(empty, _uniform_rows(v, nq).to(out.dtype), out)
    return out


def _as_sbhd(attend_bnsd, q, k, v, scale, mask, band, dropout_p) -> torch.Tensor:
    """megatron's [s, b, n, d] through a [b, n, s, d] attention; output [s, b, n * d]."""
    sq, b = q.shape[:2]
    out = attend_bnsd(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), scale, mask, band, dropout_p)
    return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def _per_sequence(attend_bnsd, q, k, v, scale, band, dropout_p, cu_q: list[int], cu_kv: list[int]) -> torch.Tensor:
    """Packed [t, n, d] sequences: one [b, n, s, d] attention call per sequence (each a
    [1, n, s_i, d] view); empty sequences are skipped. Output [t, n * d]."""
    outs = []
    for i in range(len(cu_q) - 1):
        if cu_q[i + 1] == cu_q[i]:
            continue
        qi = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1).unsqueeze(0)
        ki = k[cu_kv[i] : cu_kv[i + 1]].transpose(0, 1).unsqueeze(0)
        vi = v[cu_kv[i] : cu_kv[i + 1]].transpose(0, 1).unsqueeze(0)
        outs.append(attend_bnsd(qi, ki, vi, scale, None, band, dropout_p)[0].transpose(0, 1))
    return torch.cat(outs, dim=0).reshape(q.shape[0], -1)


def _portable_sbhd(q, k, v, scale, mask, band, dropout_p, pad_value_head: bool = True) -> torch.Tensor:
    return _as_sbhd(
        functools.partial(_portable_bnsd, pad_value_head=pad_value_head), q, k, v, scale, mask, band, dropout_p
    )


def _portable_thd(
    q, k, v, scale, band, dropout_p, cu_q: list[int], cu_kv: list[int], pad_value_head: bool = True
) -> torch.Tensor:
    """Packed sequences: one SDPA call per sequence."""
    attend = functools.partial(_portable_bnsd, pad_value_head=pad_value_head)
    return _per_sequence(attend, q, k, v, scale, band, dropout_p, cu_q, cu_kv)


# ---------------------------------------------------------------- reference (megatron's eager math)


def _reference_bnsd(q, k, v, scale, mask, band, dropout_p) -> torch.Tensor:
    nq, nk, sq, sk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    band = None if band is None else band.normalized(sq, sk)
    if nq != nk:
        k = k.repeat_interleave(nq // nk, dim=1)
        v = v.repeat_interleave(nq // nk, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    keep = _explicit_keep(mask, band, sq, sk, q.device, native_band=False)
    if keep is not None:
        scores = scores.masked_fill(~keep, MEGATRON_MASK_FILL)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, v)


def _reference_sbhd(q, k, v, scale, mask, band, dropout_p) -> torch.Tensor:
    return _as_sbhd(_reference_bnsd, q, k, v, scale, mask, band, dropout_p)


def _reference_thd(q, k, v, scale, band, dropout_p, cu_q, cu_kv) -> torch.Tensor:
    return _per_sequence(_reference_bnsd, q, k, v, scale, band, dropout_p, cu_q, cu_kv)


# ---------------------------------------------------------------- npu (npu_fusion_attention)

_compressed: dict[torch.device, torch.Tensor] = {}


def npu_compressed_mask(device: torch.device) -> torch.Tensor:
    """``triu(ones(2048, 2048), 1)`` as bool (True = masked out), one per device."""
    if device not in _compressed:
        n = NPU_COMPRESSED_MASK_SIZE
        _compressed[device] = torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)
    return _compressed[device]


def _npu_band_args(band: Band | None, device: torch.device, same_lengths: bool) -> dict:
    """sparse_mode, compressed mask and pre/next_tockens for a band the op expresses natively:
    causal as mode 2 (top-left; also when the lengths are equal, where both anchors agree) or 3
    (bottom-right with sq != sk), any other band as mode 4 (bottom-right)."""
    if band is None:
        return {}
    if band.is_causal:
        mode = 2 if same_lengths or not band.bottom_right else 3
        return dict(atten_mask=npu_compressed_mask(device), sparse_mode=mode)
    return dict(
        atten_mask=npu_compressed_mask(device),
        sparse_mode=4,
        pre_tockens=NPU_UNBOUNDED if band.left is None else band.left,
        next_tockens=NPU_UNBOUNDED if band.right is None else band.right,
    )


def _npu_native(band: Band | None, sq: int, sk: int) -> bool:
    """Bands the op takes without a materialized mask: causal top-left (2) / bottom-right (3)
    and bottom-right bands (4); a top-left band equals the bottom-right one when sq == sk.
    Bottom-right with sq > sk leaves the first rows without keys: those take the explicit path
    (and megatron's fix-up for such rows)."""
    if band is None:
        return True
    if band.bottom_right:
        return sq <= sk
    return band.is_causal or sq == sk


def _npu_sbhd(q, k, v, scale, mask, band, dropout_p) -> torch.Tensor:
    sq, b, nq, d = q.shape
    sk = k.shape[0]
    band = None if band is None else band.normalized(sq, sk)
    native = _npu_native(band, sq, sk)
    keep = _explicit_keep(mask, band, sq, sk, q.device, native_band=native)
    empty = None if keep is None else _empty_rows(keep)
    if empty is not None:
        keep = keep | empty
    kwargs: dict = dict(scale=float(scale), keep_prob=1.0 - float(dropout_p))
    if keep is not None:
        atten_mask = ~keep
        while atten_mask.dim() < 4:
            atten_mask = atten_mask.unsqueeze(0)
        kwargs.update(atten_mask=atten_mask.contiguous(), sparse_mode=1)
    elif band is not None and not band.is_full(sq, sk):
        kwargs.update(_npu_band_args(Band(band.left, band.right, band.bottom_right or sq == sk), q.device, sq == sk))
    npu = torch_npu()
    if v.shape[-1] == d:
        out = npu.npu_fusion_attention(
            q.reshape(sq, b, nq * d).contiguous(),
            k.reshape(sk, b, -1).contiguous(),
            v.reshape(sk, b, -1).contiguous(),
            nq,
            "SBH",
            **kwargs,
        )[0]
    else:  # V head dim < q/k's (multi-latent attention): BNSD names each tensor's head dim explicitly
        q4, k4, v4 = (t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v))
        out = npu.npu_fusion_attention(q4, k4, v4, nq, "BNSD", **kwargs)[0].permute(2, 0, 1, 3).reshape(sq, b, -1)
    if empty is not None:  # empty: [b|1, n|1, sq, 1] -> rows of the [sq, b, n*d] output
        uniform = _uniform_rows(v.permute(1, 2, 0, 3), nq)  # [b, nq, 1, d]
        bnsd = out.view(sq, b, nq, -1).permute(1, 2, 0, 3)
        out = torch.where(empty, uniform.to(out.dtype), bnsd).permute(2, 0, 1, 3).reshape(sq, b, -1)
    return out


def _npu_thd(q, k, v, scale, band, dropout_p, cu_q: list[int], cu_kv: list[int]) -> torch.Tensor:
    t, nq, d = q.shape
    kwargs: dict = dict(
        scale=float(scale),
        keep_prob=1.0 - float(dropout_p),
        actual_seq_qlen=cu_q[1:],  # cumulative ends WITHOUT megatron's leading 0
        actual_seq_kvlen=cu_kv[1:],
    )
    if band is not None:
        longest = max(b - a for a, b in zip(cu_q, cu_q[1:])), max(b - a for a, b in zip(cu_kv, cu_kv[1:]))
        band = Band(band.left, band.right, band.bottom_right).normalized(*longest)
        if not band.bottom_right and cu_q != cu_kv:
            raise ValueError("flash_attention: a top-left band on packed sequences needs equal q and kv lengths")
        kwargs.update(_npu_band_args(Band(band.left, band.right, True), q.device, cu_q == cu_kv))
    out = torch_npu().npu_fusion_attention(q.contiguous(), k.contiguous(), v.contiguous(), nq, "TND", **kwargs)[0]
    return out.reshape(t, -1)


# ---------------------------------------------------------------- the op


def _cu_list(cu: torch.Tensor | list[int], total: int, name: str) -> list[int]:
    values = [int(x) for x in (cu.tolist() if isinstance(cu, torch.Tensor) else cu)]
    if len(values) < 2 or values[0] != 0 or values[-1] != total or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(
            f"flash_attention: {name} must be megatron's cumulative lengths with a leading 0 ending at {total}, "
            f"got {values}"
        )
    return values


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
    band: Band | None = None,
    dropout_p: float = 0.0,
    cu_seqlens_q: torch.Tensor | list[int] | None = None,
    cu_seqlens_kv: torch.Tensor | list[int] | None = None,
    pad_value_head: bool = True,
) -> torch.Tensor:
    """Attention in megatron's layouts; no s x s matrix on the npu and portable backends.

    sbhd: ``q, k [s, b, n, d]``, ``v [sk, b, nk, dv]`` (``nq % nk == 0``: GQA; ``dv`` may differ from
    ``d``: multi-latent attention) -> ``[sq, b, nq*dv]``.
    thd (packed, when ``cu_seqlens_q`` is given): ``q [t, nq, d]``, ``k [t_kv, nk, d]``, ``v [t_kv, nk, dv]``
    with megatron's cumulative lengths (leading 0) -> ``[t, nq*dv]``; ``mask`` is not allowed there.
    ``mask``: bool, True = masked out, broadcastable to ``[b, nq, sq, sk]``. ``band``: which keys
    each query sees (``CAUSAL``, ``Band(left, right)``). ``dropout_p``: on the attention
    probabilities, drawn from the current default generator (the caller forks megatron's
    RNG tracker around the call). ``pad_value_head``: a ``dv`` different from ``d`` on CPU is padded
    for torch's fused flash kernel (default; False: the unpadded blocked kernel, MindSpeed's
    ``--mla-fa-without-pad``); the npu backend never pads (npu_fusion_attention takes Dv <= Dq).
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"flash_attention: dropout_p must be in [0, 1), got {dropout_p}")
    backend = backend_for(q)
    if backend == "npu" and v.shape[-1] > q.shape[-1]:
        backend = "portable"  # npu_fusion_attention takes Dq = Dk >= Dv only (SDPA on the device)
    if cu_seqlens_q is not None:
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError(f"flash_attention: packed (thd) input must be [t, n, d], got q {tuple(q.shape)}")
        if mask is not None:
            raise ValueError("flash_attention: packed sequences take no mask (the cumulative lengths separate them)")
        _check(q, k, v, heads_dim=1)
        cu_q = _cu_list(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
        cu_kv = _cu_list(cu_seqlens_q if cu_seqlens_kv is None else cu_seqlens_kv, k.shape[0], "cu_seqlens_kv")
        if len(cu_q) != len(cu_kv):
            raise ValueError(f"flash_attention: {len(cu_q) - 1} query sequences but {len(cu_kv) - 1} key sequences")
        if backend == "npu":
            return _npu_thd(q, k, v, scale, band, dropout_p, cu_q, cu_kv)
        if backend == "reference":
            return _reference_thd(q, k, v, scale, band, dropout_p, cu_q, cu_kv)
        return _portable_thd(q, k, v, scale, band, dropout_p, cu_q, cu_kv, pad_value_head)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attention: sbhd input must be [s, b, n, d], got q {tuple(q.shape)}")
    _check(q, k, v, heads_dim=2)
    if backend == "npu":
        return _npu_sbhd(q, k, v, scale, mask, band, dropout_p)
    if backend == "reference":
        return _reference_sbhd(q, k, v, scale, mask, band, dropout_p)
    return _portable_sbhd(q, k, v, scale, mask, band, dropout_p, pad_value_head)
