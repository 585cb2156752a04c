"""Rotary position embedding (RoPE) with a hand-written backward and shared cos/sin.

Layouts (megatron's): ``sbhd`` activations ``[s, b, n, d]`` with angles ``freqs`` of shape
``[s, 1, 1, rot_dim]`` (or ``[s, b, 1, rot_dim]``), and packed ``thd`` activations ``[t, n, d]``
with ``cu_seqlens`` (a leading 0, megatron's convention) and ``freqs`` ``[max_s, 1, 1, rot_dim]``.
Only the first ``rot_dim`` channels are rotated (``rotary_percent < 1``); the rest pass through.

Modes: ``half`` (megatron's non-interleaved rotate-half), ``interleave`` (pairs ``(2i, 2i+1)``)
and ``mla`` (megatron's multi-latent-attention variant: the input is de-interleaved into
``[even | odd]`` and then rotated half-wise; the output stays in that order).

Portable backend: partial rotation (``rot_dim < d``) runs the compiled custom op
(``kernels/compiled.py``) where the host compiles; full rotation stays on the eager Function.
That is the measured rule (benchmarks/fused_ops_rope.py, 2-core CPU, 4096x1x32x128): compiled
beat eager only with ``rotary_percent=0.5`` (63 vs 75 ms fp32, 26 vs 32 ms bf16); with full
rotation the three eager passes (swap, mul, addcmul) were faster (72 vs 83 ms fp32, 37 vs 49 ms bf16).

Why so little is saved: a rotation is orthogonal, so the backward is the inverse rotation of
the gradient and needs nothing but cos/sin. cos/sin (times ``mscale``, in the activation dtype)
are computed once per (freqs tensor, dtype, device, mscale, cu_seqlens) and shared by every
call, layer and step that uses the same ``freqs`` object (megatron's ``RotaryEmbedding.forward``
is ``lru_cache``d, so it hands out the same tensor each step). Autograd therefore saves only
references to those shared tensors.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

from mindspeed_like.kernels import compiled
from mindspeed_like.kernels.backend import backend_for
from mindspeed_like.kernels.backends.npu import torch_npu

MODES = ("half", "interleave", "mla")
# npu_rotary_mul's documented limits (notes/torch-npu-ops.md).
NPU_MAX_HEAD_DIM = 896
NPU_MAX_BN = 1000

_CACHE_SIZE = 32
_cache: OrderedDict[tuple, tuple[weakref.ref, torch.Tensor, torch.Tensor]] = OrderedDict()
_cache_lock = threading.Lock()


def clear_cache() -> None:
    """Drop every cached cos/sin pair (tests, benchmarks)."""
    with _cache_lock:
        _cache.clear()
        _signed.clear()


def _packed_positions(cu_seqlens: torch.Tensor, total: int, freqs_len: int) -> torch.Tensor:
    """Row of ``freqs`` for each packed token, as megatron's thd path picks them (CP = 1).

    When ``freqs`` has one row per packed token (``freqs_len == cu_seqlens[-1]``) megatron maps
    token i to row i; otherwise each sequence restarts at position 0.
    """
    cu = cu_seqlens.to(device="cpu", dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    if int(lengths.sum()) != total:
        raise ValueError(f"cu_seqlens covers {int(lengths.sum())} tokens but the input has {total}")
    if freqs_len == int(cu[-1]):
        return torch.arange(total)
    return torch.arange(total) - torch.repeat_interleave(cu[:-1], lengths)


def _cos_sin(
    freqs: torch.Tensor, dtype: torch.dtype, mscale: float, cu_seqlens: torch.Tensor | None, total: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        angles = freqs.detach()
        if cu_seqlens is not None:
            assert total is not None
            index = _packed_positions(cu_seqlens, total, angles.shape[0]).to(angles.device)
            angles = angles.index_select(0, index)
        cos = (torch.cos(angles) * mscale).to(dtype)
        sin = (torch.sin(angles) * mscale).to(dtype)
    return cos, sin


def cos_sin(
    freqs: torch.Tensor,
    dtype: torch.dtype,
    mscale: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
    total: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos(freqs) * mscale, sin(freqs) * mscale)`` in ``dtype``, cached and shared.

    Computed in ``freqs``' dtype then cast, exactly as megatron does, so the values are
    bit-identical to megatron's per-call ones. With ``cu_seqlens`` the result is already
    gathered per packed token: shape ``[total, 1, 1, rot_dim]``.
    """
    if freqs.is_inference():
        # made under torch.inference_mode (ms-swift's `megatron export --test_convert_precision`
        # runs the model so): no version counter (`_version` raises), so a cache entry could not
        # tell an in-place change of it; computed each call
        return _cos_sin(freqs, dtype, mscale, cu_seqlens, total)
    cu_key = None if cu_seqlens is None else tuple(cu_seqlens.tolist())
    key = (id(freqs), freqs._version, dtype, freqs.device, float(mscale), cu_key, total)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and hit[0]() is freqs:
            _cache.move_to_end(key)
            return hit[1], hit[2]
    cos, sin = _cos_sin(freqs, dtype, mscale, cu_seqlens, total)
    with _cache_lock:
        _cache[key] = (weakref.ref(freqs), cos, sin)
        _cache.move_to_end(key)
        for stale in [k for k, v in _cache.items() if v[0]() is None]:
            del _cache[stale]
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return cos, sin


def _views(mode: str, rot_dim: int) -> tuple[slice, slice, slice, slice]:
    """(input a, input b, output a, output b) channel slices of the rotated part.

    Each output pair is ``out_a = x_a cos_a - x_b sin_a``, ``out_b = x_b cos_b + x_a sin_b``
    (cos/sin indexed by output channel), i.e. ``x * cos + rotate(x) * sin``.
    """
    half = rot_dim // 2
    if mode == "half":
        a, b = slice(0, half), slice(half, rot_dim)
        return a, b, a, b
    if mode == "interleave":
        a, b = slice(0, rot_dim, 2), slice(1, rot_dim, 2)
        return a, b, a, b
    if mode == "mla":
        return slice(0, rot_dim, 2), slice(1, rot_dim, 2), slice(0, half), slice(half, rot_dim)
    raise ValueError(f"unknown rotary mode {mode!r}; choose one of {MODES}")


def _swap(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The rotate permutation without its sign: halves swapped (``half``) or pairs swapped."""
    if mode == "half":
        half = x.shape[-1] // 2
        return torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.stack((x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


_signed: dict[int, tuple[weakref.ref, str, torch.Tensor]] = {}


def _signed_sin(sin: torch.Tensor, mode: str) -> torch.Tensor:
    """``sin`` with rotate's sign folded in (``-sin`` on the channels that receive ``-x``), so
    ``rotate(x) * sin == swap(x) * signed_sin``; cached per shared ``sin`` tensor like cos/sin."""
    hit = _signed.get(id(sin))
    if hit is not None and hit[0]() is sin and hit[1] == mode:
        return hit[2]
    signed = sin.clone()
    if mode == "half":
        signed[..., : sin.shape[-1] // 2].neg_()
    else:
        signed[..., 0::2].neg_()
    for key in [k for k, v in _signed.items() if v[0]() is None]:
        del _signed[key]
    _signed[id(sin)] = (weakref.ref(sin), mode, signed)
    return signed


class _PortableRope(torch.autograd.Function):
    """``half``/``interleave``: out = x * cos + swap(x) * signed_sin, three contiguous passes
    (megatron's eager path makes about six); backward dx = g * cos + swap(g * signed_sin), since
    swap is its own transpose. ``mla`` (output order differs from input order) works on strided
    channel views instead. Saves only the shared cos and (signed) sin."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
        rot_dim = cos.shape[-1]
        ctx.mode = mode
        if mode != "mla":
            signed = _signed_sin(sin, mode)
            x = t[..., :rot_dim]
            out = _swap(x, mode).mul_(signed).addcmul_(x, cos)
            if rot_dim < t.shape[-1]:
                out = torch.cat((out, t[..., rot_dim:]), dim=-1)
            ctx.save_for_backward(cos, signed)
            return out
        ia, ib, oa, ob = _views(mode, rot_dim)
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
        xa, xb = t[..., ia], t[..., ib]
        out_a, out_b = out[..., oa], out[..., ob]
        torch.mul(xa, cos[..., oa], out=out_a)
        out_a.addcmul_(xb, sin[..., oa], value=-1)
        torch.mul(xb, cos[..., ob], out=out_b)
        out_b.addcmul_(xa, sin[..., ob])
        if rot_dim < t.shape[-1]:
            out[..., rot_dim:].copy_(t[..., rot_dim:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        rot_dim = cos.shape[-1]
        if ctx.mode != "mla":
            g = grad[..., :rot_dim]
            dx = _swap(g * sin, ctx.mode).addcmul_(g, cos)  # sin is the signed sin here
            if rot_dim < grad.shape[-1]:
                dx = torch.cat((dx, grad[..., rot_dim:]), dim=-1)
            return dx, None, None, None
        ia, ib, oa, ob = _views(ctx.mode, rot_dim)
        dx = torch.empty_like(grad, memory_format=torch.contiguous_format)
        ga, gb = grad[..., oa], grad[..., ob]
        dx_a, dx_b = dx[..., ia], dx[..., ib]
        torch.mul(ga, cos[..., oa], out=dx_a)
        dx_a.addcmul_(gb, sin[..., ob])
        torch.mul(gb, cos[..., ob], out=dx_b)
        dx_b.addcmul_(ga, sin[..., oa], value=-1)
        if rot_dim < grad.shape[-1]:
            dx[..., rot_dim:].copy_(grad[..., rot_dim:])
        return dx, None, None, None


def _reference(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    """Plain eager math (the oracle): megatron's formula, autograd does the backward."""
    rot_dim = cos.shape[-1]
    x, rest = t[..., :rot_dim], t[..., rot_dim:]
    if mode == "mla":
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    if mode == "interleave":
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x * cos + rotated * sin, rest), dim=-1)


def _npu_fits(t4: torch.Tensor, cos: torch.Tensor, mode: str) -> bool:
    s, b, n, d = t4.shape
    rot_dim = cos.shape[-1]
    if rot_dim % 2 or rot_dim >= NPU_MAX_HEAD_DIM or b >= NPU_MAX_BN or n >= NPU_MAX_BN:
        return False
    if mode == "interleave" and b * n >= NPU_MAX_BN:
        return False
    return tuple(cos.shape[1:3]) == (1, 1) and t4.dtype in (torch.float16, torch.bfloat16, torch.float32)


def _npu(t4: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    """torch_npu.npu_rotary_mul on SBND input with S11D cos/sin; it rotates the whole last dim,
    so the rotated part is split off (and, for ``mla``, de-interleaved) first."""
    rot_dim = cos.shape[-1]
    x, rest = t4[..., :rot_dim], t4[..., rot_dim:]
    if mode == "mla":
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    out = torch_npu().npu_rotary_mul(
        x.contiguous(), cos, sin, rotary_mode="interleave" if mode == "interleave" else "half"
    )
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def apply_rope(
    t: torch.Tensor,
    freqs: torch.Tensor,
    *,
    mode: str = "half",
    mscale: float = 1.0,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Rotate ``t`` by the angles ``freqs`` (megatron's ``apply_rotary_pos_emb`` math, CP = 1).

    ``t``: ``[s, b, n, d]`` or, with ``cu_seqlens``, packed ``[t, n, d]``. ``freqs``: angles
    ``[s, 1|b, 1, rot_dim]`` with ``rot_dim <= d`` even. ``backend`` overrides
    :func:`backend_for` (``npu``, ``portable``, ``reference``). Gradients flow to ``t`` only.
    """
    if mode not in MODES:
        raise ValueError(f"unknown rotary mode {mode!r}; choose one of {MODES}")
    rot_dim = freqs.shape[-1]
    if rot_dim % 2 or rot_dim > t.shape[-1]:
        raise ValueError(f"rot_dim {rot_dim} must be even and at most the head dim {t.shape[-1]}")
    packed = cu_seqlens is not None
    if packed:
        if t.dim() != 3:
            raise ValueError(f"packed (thd) input must be [t, n, d], got {tuple(t.shape)}")
        cos, sin = cos_sin(freqs, t.dtype, mscale, cu_seqlens, t.shape[0])
        t4 = t.unsqueeze(1)
    else:
        if t.dim() != 4:
            raise ValueError(f"input must be [s, b, n, d], got {tuple(t.shape)}")
        cos, sin = cos_sin(freqs, t.dtype, mscale)
        if cos.shape[0] != t.shape[0]:
            cos, sin = cos[: t.shape[0]], sin[: t.shape[0]]
        t4 = t
    chosen = backend or backend_for(t)
    if chosen == "npu" and _npu_fits(t4, cos, mode):
        out = _npu(t4, cos, sin, mode)
    elif chosen == "reference":
        out = _reference(t4, cos, sin, mode)
    elif chosen in ("npu", "cuda", "portable"):  # no CUDA-specific RoPE: cuda runs the portable op
        if mode != "mla" and cos.shape[-1] < t4.shape[-1] and compiled.active(t4):
            out = compiled.rope(t4, cos, _signed_sin(sin, mode), mode == "interleave")
        else:
            out = _PortableRope.apply(t4, cos, sin, mode)
    else:
        raise ValueError(f"unknown backend {chosen!r}")
    return out.squeeze(1) if packed else out
