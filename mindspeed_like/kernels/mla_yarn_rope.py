"""Multi-latent attention's fused YaRN RoPE apply, as torch operations that run on any device.

megatron-core 0.16's ``fusions.fused_mla_yarn_rope_apply`` (``fused_apply_mla_rope_for_q`` and
``fused_apply_mla_rope_for_kv``) is four Triton kernels: they need a GPU, and MLA with
``apply_rope_fusion`` has no other path once cos/sin come from ``get_cached_cos_sin``. This module
keeps their contract (arguments, layouts, in-place behaviour, gradients) so the cpu adapter can bind it
under megatron's names.

The rotation (both functions, read from the kernels): of the ``emb_dim`` rotary channels, the inputs
are read interleaved, ``x1 = x[0::2]``, ``x2 = x[1::2]``, and written half-wise,
``left = x1 * cos[:h] - x2 * sin[:h]``, ``right = x2 * cos[h:] + x1 * sin[h:]`` (``h = emb_dim // 2``),
with ``cos``/``sin`` ``[max_seq_len, 1, 1, emb_dim]`` already scaled by YaRN's mscale. Backward is the
transpose: ``dx1 = dl * cos[:h] + dr * sin[h:]``, ``dx2 = -dl * sin[:h] + dr * cos[h:]``, written back
interleaved.

* ``mla_rope_q(t, cos, sin, qk_head_dim, emb_dim, ...)``: ``t`` ``[s, b, n, qk_head_dim + emb_dim]``
  (sbhd) or ``[t, n, qk_head_dim + emb_dim]`` (thd). The last ``emb_dim`` channels are rotated **in
  place** (megatron documents it: "inplace modifies the input tensor t"); the first ``qk_head_dim`` are
  untouched. Its gradient passes the first channels through and rotates the rest back.
* ``mla_rope_kv(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, ...)``: ``kv``
  ``[..., n, k_dim + v_dim]``, ``k_pos_emb`` ``[s, b, 1, emb_dim]`` or ``[t, 1, emb_dim]`` (one rotary
  key shared by every head). Returns new tensors ``key [..., n, k_dim + emb_dim]`` (``kv``'s ``k_dim``
  channels, then the rotated ``k_pos_emb``) and ``value [..., n, v_dim]``. The gradient of
  ``k_pos_emb`` is the sum over heads of the key's rotary gradient (accumulated in float32 and rounded
  to the gradient's dtype before the rotation, as the kernel does), rotated back.

Positions: sbhd row ``i`` of the sequence dimension uses ``cos[i]`` (``cp_rank``/``cp_size`` are not
read: the caller's cos/sin are this rank's). thd token ``m`` uses its offset in its sequence, with
``cu_seqlens`` divided by ``cp_size`` (each rank holds ``1/cp`` of every sequence) and, for
``cp_size > 1``, the load-balanced chunks megatron deals out: the first half of a rank's share is chunk
``cp_rank`` of ``2 * cp_size``, the second half chunk ``2 * cp_size - cp_rank - 1``.

Arithmetic: each product is formed in the promotion of the input's and cos's dtypes, at least float32,
and rounded once to the output's dtype (the kernel upcasts bf16 loads the same way, up to FMA
contraction). Two deliberate departures, neither visible in values: the backward does not overwrite the
incoming gradient (the kernel rotates it in place; autograd may hand the same tensor to another
consumer), and float64 inputs are accumulated in float64 (the kernel's accumulator is float32).
"""

from __future__ import annotations

import torch


def _check(emb_dim: int, cos: torch.Tensor, sin: torch.Tensor, rotary_interleaved: bool) -> None:
    """The kernels' own assertions, as errors that say which argument is wrong."""
    if rotary_interleaved:
        raise NotImplementedError("fused MLA RoPE: rotary_interleaved=True is not supported (megatron's neither)")
    if emb_dim % 4 != 0:
        raise ValueError(f"fused MLA RoPE: emb_dim must be a multiple of 4, got {emb_dim}")
    for name, x in (("cos", cos), ("sin", sin)):
        if x.shape[-1] != emb_dim or x.numel() % emb_dim != 0:
            raise ValueError(f"fused MLA RoPE: {name} {tuple(x.shape)} must be [max_seq_len, 1, 1, {emb_dim}]")


def token_positions(
    tokens: int, cu_seqlens: torch.Tensor | None, cp_rank: int, cp_size: int, batch: int = 1
) -> torch.Tensor:
    """The cos/sin row of each of ``tokens`` rows (flattened ``[s * b]`` for sbhd, ``[t]`` for thd).

    thd mirrors megatron's ``_get_thd_token_idx`` integer for integer (``//`` after ``*``).
    """
    if cu_seqlens is None:
        return torch.arange(tokens) // batch
    cu = cu_seqlens.detach().to("cpu", torch.long) // cp_size
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"fused MLA RoPE: cu_seqlens must be [seq_num + 1], got {tuple(cu_seqlens.shape)}")
    if int(cu[0]) != 0 or tokens > int(cu[-1]):
        raise ValueError(
            f"fused MLA RoPE: cu_seqlens must start at 0 and, divided by cp_size={cp_size}, cover the "
            f"{tokens} packed tokens; got cu_seqlens[0]={int(cu_seqlens[0])}, cu_seqlens[-1]={int(cu_seqlens[-1])}"
        )
    m = torch.arange(tokens)
    seq = torch.searchsorted(cu[1:], m, right=True)
    start, length = cu[seq], cu[seq + 1] - cu[seq]
    idx = m - start
    if cp_size > 1:
        first = idx < length // 2
        idx = torch.where(
            first,
            idx + cp_rank * length // 2,
            (idx - length // 2) + (2 * cp_size - cp_rank - 1) * length // 2,
        )
    return idx


def _angles(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, emb_dim: int, dtype: torch.dtype):
    """(cos_left, cos_right, sin_left, sin_right) of each position, ``[tokens, 1, h]`` in ``dtype``."""
    rows = cos.reshape(-1, emb_dim).shape[0]
    if pos.numel() and not 0 <= int(pos.min()) <= int(pos.max()) < rows:
        raise ValueError(f"fused MLA RoPE: positions {int(pos.min())}..{int(pos.max())} outside cos/sin's {rows} rows")
    pos = pos.to(cos.device)
    c = cos.reshape(-1, emb_dim).index_select(0, pos).to(dtype).unsqueeze(1)
    s = sin.reshape(-1, emb_dim).index_select(0, pos).to(dtype).unsqueeze(1)
    h = emb_dim // 2
    return c[..., :h], c[..., h:], s[..., :h], s[..., h:]


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


def _rotate(x: torch.Tensor, angles, dtype: torch.dtype) -> torch.Tensor:
    """Interleaved ``x [tokens, n, emb]`` -> half-wise rotated, in ``dtype``."""
    cl, cr, sl, sr = angles
    x = x.to(dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cl - x2 * sl, x2 * cr + x1 * sr], dim=-1)


def _rotate_back(g: torch.Tensor, angles, dtype: torch.dtype) -> torch.Tensor:
    """Half-wise gradient ``g [tokens, n, emb]`` -> the interleaved input's gradient, in ``dtype``."""
    cl, cr, sl, sr = angles
    g = g.to(dtype)
    h = g.shape[-1] // 2
    gl, gr = g[..., :h], g[..., h:]
    return torch.stack([gl * cl + gr * sr, -gl * sl + gr * cr], dim=-1).flatten(-2)


def _flat(x: torch.Tensor, thd: bool) -> tuple[torch.Tensor, int]:
    """``[s, b, n, d]`` -> ``[s * b, n, d]`` (batch returned) or ``[t, n, d]`` as is (batch 1)."""
    if thd:
        if x.dim() != 3:
            raise ValueError(f"fused MLA RoPE: thd input must be [total_seq_len, heads, dim], got {tuple(x.shape)}")
        return x, 1
    if x.dim() != 4:
        raise ValueError(f"fused MLA RoPE: sbhd input must be [seq, batch, heads, dim], got {tuple(x.shape)}")
    return x.reshape(-1, *x.shape[2:]), x.shape[1]


class MLARopeQ(torch.autograd.Function):
    """Rotates the query's rotary channels in place; saves only cos/sin and the positions."""

    @staticmethod
    def forward(ctx, t, cos, sin, qk_head_dim, emb_dim, cu_seqlens, cp_rank, cp_size, rotary_interleaved):
        _check(emb_dim, cos, sin, rotary_interleaved)
        if t.shape[-1] != qk_head_dim + emb_dim:
            raise ValueError(f"fused MLA RoPE: q's last dimension {t.shape[-1]} != {qk_head_dim} + {emb_dim}")
        flat, batch = _flat(t, cu_seqlens is not None)
        pos = token_positions(flat.shape[0], cu_seqlens, cp_rank, cp_size, batch)
        dtype = _compute_dtype(t.dtype, cos.dtype)
        rotated = _rotate(flat[..., qk_head_dim:], _angles(cos, sin, pos, emb_dim, dtype), dtype)
        t[..., qk_head_dim:] = rotated.view(*t.shape[:-1], emb_dim)  # megatron's contract: in place
        ctx.save_for_backward(cos, sin, pos)
        ctx.qk_head_dim, ctx.emb_dim = qk_head_dim, emb_dim
        return t.view(t.shape)  # a view, as megatron's sbhd path returns (t itself is not marked dirty)

    @staticmethod
    def backward(ctx, grad):
        cos, sin, pos = ctx.saved_tensors
        qk, emb = ctx.qk_head_dim, ctx.emb_dim
        flat, _ = _flat(grad, grad.dim() == 3)
        dtype = _compute_dtype(grad.dtype, cos.dtype)
        back = _rotate_back(flat[..., qk:], _angles(cos, sin, pos, emb, dtype), dtype).to(grad.dtype)
        out = torch.cat([flat[..., :qk], back], dim=-1).view(grad.shape)
        return out, None, None, None, None, None, None, None, None


class MLARopeKV(torch.autograd.Function):
    """Splits kv into key and value and appends the rotated shared rotary key to every head's key."""

    @staticmethod
    def forward(ctx, kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens, cp_rank, cp_size, interleaved):
        _check(emb_dim, cos, sin, interleaved)
        if kv.shape[-1] != k_dim + v_dim:
            raise ValueError(f"fused MLA RoPE: kv's last dimension {kv.shape[-1]} != {k_dim} + {v_dim}")
        thd = cu_seqlens is not None
        flat, batch = _flat(kv, thd)
        tokens, heads = flat.shape[:2]
        if k_pos_emb.numel() != tokens * emb_dim:
            raise ValueError(
                f"fused MLA RoPE: k_pos_emb {tuple(k_pos_emb.shape)} must hold one [{emb_dim}] row per token "
                f"of kv {tuple(kv.shape)} ([s, b, 1, emb_dim] or [t, 1, emb_dim])"
            )
        pos = token_positions(tokens, cu_seqlens, cp_rank, cp_size, batch)
        dtype = _compute_dtype(k_pos_emb.dtype, cos.dtype)
        emb = k_pos_emb.reshape(tokens, 1, emb_dim)
        rotated = _rotate(emb, _angles(cos, sin, pos, emb_dim, dtype), dtype).to(kv.dtype)
        key = torch.cat([flat[..., :k_dim], rotated.expand(tokens, heads, emb_dim)], dim=-1)
        value = flat[..., k_dim:].contiguous()
        ctx.save_for_backward(cos, sin, pos)
        ctx.dims, ctx.lead, ctx.emb_shape = (emb_dim, k_dim, v_dim), kv.shape[:-1], k_pos_emb.shape
        lead = kv.shape[:-1]
        return key.view(*lead, k_dim + emb_dim), value.view(*lead, v_dim)

    @staticmethod
    def backward(ctx, dk, dv):
        cos, sin, pos = ctx.saved_tensors
        emb_dim, k_dim, v_dim = ctx.dims
        tokens = pos.numel()
        dk = dk.reshape(tokens, -1, k_dim + emb_dim)
        dv = dv.reshape(tokens, -1, v_dim)
        d_kv = torch.cat([dk[..., :k_dim], dv.to(dk.dtype)], dim=-1).view(*ctx.lead, k_dim + v_dim)
        # the kernel: heads summed in a float32 accumulator, rounded to dEMB's (= dk's) dtype, then rotated
        summed = dk[..., k_dim:].to(_compute_dtype(dk.dtype)).sum(dim=1, keepdim=True).to(dk.dtype)
        dtype = _compute_dtype(dk.dtype, cos.dtype)
        d_emb = _rotate_back(summed, _angles(cos, sin, pos, emb_dim, dtype), dtype).to(dk.dtype)
        return d_kv, d_emb.view(ctx.emb_shape), None, None, None, None, None, None, None, None, None


def mla_rope_q(
    t: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qk_head_dim: int,
    emb_dim: int,
    cu_seqlens_q: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    rotary_interleaved: bool = False,
) -> torch.Tensor:
    """megatron's ``fused_apply_mla_rope_for_q`` (same arguments; ``t`` is modified in place)."""
    return MLARopeQ.apply(t, cos, sin, qk_head_dim, emb_dim, cu_seqlens_q, cp_rank, cp_size, rotary_interleaved)


def mla_rope_kv(
    kv: torch.Tensor,
    k_pos_emb: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    emb_dim: int,
    k_dim: int,
    v_dim: int,
    cu_seqlens_kv: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    rotary_interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's ``fused_apply_mla_rope_for_kv`` (same arguments): ``(key, value)``, new tensors."""
    return MLARopeKV.apply(
        kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens_kv, cp_rank, cp_size, rotary_interleaved
    )
