"""TransformerEngine's rotary position embedding (TE 2.1's contract) on our RoPE kernel, and the two
functions megatron's ``apply_rope_fusion`` calls, ``fused_apply_rotary_pos_emb`` and
``fused_apply_rotary_pos_emb_thd``.

Why here: megatron's RoPE fusion is not a kernel of megatron's but TE's. ``megatron.core.extensions.
transformer_engine`` defines ``fused_apply_rotary_pos_emb`` / ``_thd`` only when
``from transformer_engine.pytorch.attention import apply_rotary_pos_emb`` succeeds at its import, and
``models.common.embeddings.rope_utils`` takes them from there (None without TE, so
``TransformerConfig(apply_rope_fusion=True)`` raises "apply_rope_fusion is not available"). The
te-backend binds both names (PROVIDE) to the functions below, which are megatron's own wrappers as
written for the TE version this backend answers (:data:`versions.TE_LAYERS_API`, 2.1.0), calling
:func:`apply_rotary_pos_emb`. The te-client-module serves the same :func:`apply_rotary_pos_emb` as
``transformer_engine.pytorch.attention.apply_rotary_pos_emb`` (where TE 2.1 defines it).

TE 2.1's ``apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", fused=False, cu_seqlens=None,
cp_size=1, cp_rank=0)`` (``transformer_engine/pytorch/attention.py`` at tag v2.1, and its CUDA kernels
``common/fused_rope/fused_rope.cu``), reproduced:

* rotate-half RoPE only: TE 2.1 has no ``interleaved`` argument (added in 2.3; megatron refuses
  ``rotary_interleaved`` with ``apply_rope_fusion`` below 2.3, and so does its wrapper here);
* ``freqs`` ``[s2, 1, 1, d2]`` angles with ``s2 >= s``; the first ``s`` rows are used; only the
  first ``d2 <= d`` channels rotate, the rest pass through unchanged;
* ``fused=False``: ``sbhd`` / ``bshd`` only; cos/sin computed in ``freqs``' dtype, cast to ``t``'s,
  then the arithmetic in ``t``'s dtype (TE's torch path);
* ``fused=True``: ``sbhd`` / ``bshd`` / ``thd``; ``freqs`` made float32, the arithmetic in float32
  with one rounding to ``t``'s dtype (TE's kernel reads each element as float, ``sincosf``s the
  angle and writes ``x cos + rotate(x) sin``); ``bshd`` output contiguous in ``bshd``;
* ``thd`` (fused only): packed ``[T, h, d]`` with ``cu_seqlens`` ``[b + 1]`` (the padded ones under
  context parallelism); every sequence starts at angle row 0; with ``cp_size > 1`` the rank holds
  rows ``cu_seqlens[i] // cp_size ...`` of sequence ``i``, the two zigzag chunks ``cp_rank`` and
  ``2 cp_size - 1 - cp_rank``, and its rows take those positions' angles (the kernel's
  ``s_id_for_freqs``);
* gradients flow to ``t`` only (TE's backward returns none for ``freqs``).

Where TE's kernel would read out of bounds or assert (angle rows missing, an odd local sequence
length under context parallelism, a bad layout), a ``ValueError`` names the argument. Rows of a
``thd`` input that no sequence covers (TE leaves them unwritten) come back unchanged.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import OrderedDict

import torch

from mindspeed_like.kernels.rope import apply_rope

FORMATS = ("sbhd", "bshd", "thd")

_THD_CACHE_SIZE = 8
_thd_cache: OrderedDict[tuple, tuple[weakref.ref, torch.Tensor]] = OrderedDict()
_thd_lock = threading.Lock()


def _check_freqs(freqs: torch.Tensor, t: torch.Tensor, seq_len: int | None, fused: bool) -> None:
    if freqs.dim() != 4:
        raise ValueError(f"freqs must be 4-D [s, 1, 1, d2] angles (TE's layout), got shape {tuple(freqs.shape)}")
    if fused and (freqs.shape[1], freqs.shape[2]) != (1, 1):
        raise ValueError(f"fused RoPE takes freqs [s, 1, 1, d2] (TE's kernel), got shape {tuple(freqs.shape)}")
    rot_dim = freqs.shape[-1]
    if rot_dim > t.shape[-1] or rot_dim % 2:
        raise ValueError(
            f"freqs' last dim ({rot_dim}) must be even and at most the input's head dim ({t.shape[-1]}): the first "
            "d2 channels rotate, the rest pass through"
        )
    if seq_len is not None and freqs.shape[0] < seq_len:
        raise ValueError(
            f"freqs has {freqs.shape[0]} positions for an input of sequence length {seq_len} (TE: rotary "
            f"embeddings only up to {freqs.shape[0]})"
        )


def _thd_positions(cu_seqlens: torch.Tensor, total: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The angle row of every packed row of this CP rank (TE 2.1's ``fused_rope_thd`` kernels):
    ``-1`` for rows outside every sequence."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [b + 1], got shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.detach().to(device="cpu", dtype=torch.long)
    if bool((cu[1:] < cu[:-1]).any()) or int(cu[0]) < 0:
        raise ValueError(f"cu_seqlens must be non-negative and non-decreasing, got {cu.tolist()}")
    starts, ends = cu[:-1] // cp_size, cu[1:] // cp_size
    if int(ends[-1]) > total:
        raise ValueError(
            f"cu_seqlens covers {int(ends[-1])} rows per CP rank (cu_seqlens[-1] // cp_size) but the input has {total}"
        )
    lengths = ends - starts
    if cp_size > 1 and bool((lengths % 2).any()):
        raise ValueError(
            f"with cp_size={cp_size} every sequence's local length must be even (two zigzag chunks), got "
            f"{lengths.tolist()}: pass the padded cu_seqlens"
        )
    positions = torch.full((total,), -1, dtype=torch.long)
    rows = torch.arange(int(starts[0]), int(ends[-1]))
    sequence = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    s_id = rows - starts[sequence]
    if cp_size > 1:
        local, half = lengths[sequence], lengths[sequence] // 2
        first = s_id < half
        positions[rows] = torch.where(
            first, s_id + cp_rank * half, local * cp_size - (cp_rank + 1) * half + s_id - half
        )
    else:
        positions[rows] = s_id
    return positions


def _thd_freqs(freqs: torch.Tensor, cu_seqlens: torch.Tensor, total: int, cp_size: int, cp_rank: int):
    """``freqs`` gathered per packed row ``[T, 1, 1, d2]`` (zero angle, the identity, for rows outside
    every sequence). Cached per (freqs object and version, cu_seqlens, CP rank), so q and k of a
    layer share the gathered angles and therefore the kernel's cached cos/sin."""
    key = (id(freqs), freqs._version, freqs.device, tuple(cu_seqlens.tolist()), total, cp_size, cp_rank)
    with _thd_lock:
        hit = _thd_cache.get(key)
        if hit is not None and hit[0]() is freqs:
            _thd_cache.move_to_end(key)
            return hit[1]
    positions = _thd_positions(cu_seqlens, total, cp_size, cp_rank)
    if total and int(positions.max()) >= freqs.shape[0]:
        raise ValueError(
            f"freqs has {freqs.shape[0]} positions; the packed sequences need {int(positions.max()) + 1} "
            f"(cp_size={cp_size}, cp_rank={cp_rank})"
        )
    with torch.no_grad():
        gathered = freqs.detach().index_select(0, positions.clamp(min=0).to(freqs.device))
        outside = positions < 0
        if bool(outside.any()):
            gathered[outside.to(freqs.device)] = 0.0
    with _thd_lock:
        _thd_cache[key] = (weakref.ref(freqs), gathered)
        for stale in [k for k, v in _thd_cache.items() if v[0]() is None]:
            del _thd_cache[stale]
        while len(_thd_cache) > _THD_CACHE_SIZE:
            _thd_cache.popitem(last=False)
    return gathered


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    fused: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """TE 2.1's ``apply_rotary_pos_emb``: rotate ``t`` (``[s, b, h, d]``, ``[b, s, h, d]`` or packed
    ``[T, h, d]``) by the angles ``freqs`` (``[s2, 1, 1, d2]``, ``s2 >= s``, ``d2 <= d``) on our RoPE
    kernel; the module docstring lists the contract."""
    if tensor_format not in FORMATS:
        raise ValueError(f"tensor_format must be one of {FORMATS}, got {tensor_format!r}")
    if not fused and tensor_format == "thd":
        raise ValueError("tensor_format 'thd' is only supported with fused=True (TE's contract)")
    if tensor_format != "thd" and t.dim() != 4:
        raise ValueError(f"a {tensor_format} input must be 4-D, got shape {tuple(t.shape)}")
    if fused and freqs.dtype != torch.float32:
        freqs = freqs.float()  # TE's FusedRoPEFunc does the same
    if tensor_format == "thd":
        if t.dim() != 3:
            raise ValueError(f"a thd input must be 3-D [T, h, d], got shape {tuple(t.shape)}")
        if cu_seqlens is None:
            raise ValueError("cu_seqlens must not be None when tensor_format is 'thd'")
        if cp_size < 1 or not 0 <= cp_rank < cp_size:
            raise ValueError(f"need cp_size >= 1 and 0 <= cp_rank < cp_size, got cp_size={cp_size}, cp_rank={cp_rank}")
        _check_freqs(freqs, t, None, fused=True)
        per_row = _thd_freqs(freqs, cu_seqlens, t.shape[0], cp_size, cp_rank)
        return _fused(t.unsqueeze(1), per_row).squeeze(1)
    seq_len = t.shape[1] if tensor_format == "bshd" else t.shape[0]
    _check_freqs(freqs, t, seq_len, fused)
    if tensor_format == "bshd":
        if freqs.shape[1] != 1:
            raise ValueError(f"bshd takes freqs [s, 1, 1, d2], got shape {tuple(freqs.shape)}")
        out = (_fused if fused else _unfused)(t.transpose(0, 1), freqs)
        return out.transpose(0, 1).contiguous()
    return (_fused if fused else _unfused)(t, freqs)


def _unfused(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """TE's torch path: cos/sin in ``freqs``' dtype cast to ``t``'s, arithmetic in ``t``'s dtype."""
    return apply_rope(t, freqs[: t.shape[0]], mode="half")


def _fused(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """TE's kernel: float32 angles and arithmetic, one rounding to ``t``'s dtype."""
    if t.dtype in (torch.float32, torch.float64):
        return apply_rope(t, freqs[: t.shape[0]], mode="half")
    return apply_rope(t.float(), freqs[: t.shape[0]], mode="half").to(t.dtype)


# ------------------------------------------------------------------------------------ megatron's names
def fused_apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    transpose_output_memory: bool = False,
    interleaved: bool = False,
) -> torch.Tensor:
    """megatron's ``fused_apply_rotary_pos_emb`` (``extensions/transformer_engine.py``) as it runs on
    TE 2.1: ``sbhd`` through TE's fused RoPE; ``interleaved`` is refused as megatron refuses it below
    TE 2.3."""
    if transpose_output_memory:
        warnings.warn("transpose_output_memory is not supported by TE's fused RoPE and will be ignored.", stacklevel=2)
    _refuse_interleaved(interleaved)
    return apply_rotary_pos_emb(t, freqs, tensor_format="sbhd", fused=True)


def _refuse_interleaved(interleaved: bool) -> None:
    if interleaved:
        raise ValueError(
            "Only TE >= 2.3.0 supports interleaved fused RoPE (the te-backend implements TE 2.1's API; "
            "leave apply_rope_fusion off for rotary_interleaved, or use --use-fused-rotary-pos-emb)"
        )


def fused_apply_rotary_pos_emb_thd(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    cp_size: int = 1,
    cp_rank: int = 0,
    interleaved: bool = False,
) -> torch.Tensor:
    """megatron's ``fused_apply_rotary_pos_emb_thd``: packed ``thd`` through TE's fused RoPE, with
    context parallelism (TE >= 1.12 takes ``cp_size`` / ``cp_rank``); megatron-core 0.19 also passes
    ``interleaved``, refused as for ``sbhd``."""
    _refuse_interleaved(interleaved)
    return apply_rotary_pos_emb(
        t, freqs, tensor_format="thd", fused=True, cu_seqlens=cu_seqlens, cp_size=cp_size, cp_rank=cp_rank
    )


def clear_cache() -> None:
    """Drop the cached per-row thd angles (tests)."""
    with _thd_lock:
        _thd_cache.clear()


__all__ = ["apply_rotary_pos_emb", "fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_thd"]
