"""fused-rotary-pos-emb's mechanism: megatron's RoPE dispatcher runs the fused rotation.

Target: ``megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb`` (WRAP).
It is the single entry point of megatron's training-time RoPE: ``transformer.attention``
(``Attention.forward``, q and k, sbhd or packed thd) calls it through its own by-name alias,
as do ``multi_latent_attention``, ``models.common.embeddings``, ``rotary_pos_embedding``,
``inference.contexts.dynamic_context`` and ``experimental_attention_variant.dsa``. The engine
updates those aliases when it wraps a module-level function, so one patch covers them all.
The private helpers (``_apply_rotary_pos_emb_bshd`` / ``_thd``) are not patched: they are also
called from ``rotary_pos_embedding`` for other purposes, and the dispatcher is where ``config``,
``cu_seqlens``, ``mscale`` and ``cp_group`` are all visible. A WRAP (not a REPLACE) so megatron's
own function stays underneath for the cases we hand back to it.

Handled here (megatron's signature ``(t, freqs, config, cu_seqlens=None, mscale=1.0,
cp_group=None)``, and from 0.19 ``mla_rotary_interleaved=False``): sbhd and thd, half /
interleaved rotation, multi-latent attention's de-interleaving (non-interleaved only; asked by
``config.multi_latent_attention`` up to 0.18, by the call's ``mla_rotary_interleaved`` from
0.19), partial rotary, mscale.
``config.apply_rope_fusion`` where the te-backend serves megatron's fused RoPE: megatron's path,
unlogged (it is TE's contract on this same kernel).
Handed back to megatron (logged once per reason; an error under ``strict``): context parallel
> 1, ``config.apply_rope_fusion`` (a real TransformerEngine's path, which the user chose),
MLA with ``rotary_interleaved``, freqs that require grad, thd freqs with a batch dim, and
shapes the kernel does not take.

Not covered: ``apply_rotary_pos_emb_with_cos_sin`` (inference with precomputed cos/sin in
``Attention._adjust_key_value_for_inference``) and TE's ``apply_fused_qkv_rotary_pos_emb``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed_like.toolkit import transformer_engine
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.errors import FeatureUnsupported
from mindspeed_like.toolkit.fallback import Fallback


class FusedRopeUnsupported(FeatureUnsupported):
    """``strict`` is on and a call cannot use the fused RoPE."""


def _cp_size(cp_group) -> int:
    if cp_group is not None:
        return cp_group.size()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


def mla_interleaved(call: Call) -> bool:
    """Whether this call de-interleaves the input first (multi-latent attention's layout).

    Up to megatron-core 0.18 that is ``config.multi_latent_attention``; 0.19 made it the
    argument ``mla_rotary_interleaved`` (default False; None means the config's value), which
    MLA passes as True and other callers (e.g. DSA's indexer) set from their own config."""
    if "mla_rotary_interleaved" in call:
        value = call["mla_rotary_interleaved"]
        if value is not None:
            return bool(value)
    return bool(getattr(call["config"], "multi_latent_attention", False))


def _unsupported(call: Call, per_token_thd_freqs: bool) -> str | None:
    """Why this call goes back to megatron, or None when the fused kernel takes it."""
    t, freqs, config = call["t"], call["freqs"], call["config"]
    if getattr(config, "apply_rope_fusion", False):
        return "config.apply_rope_fusion selects megatron's TransformerEngine RoPE"
    if _cp_size(call.get("cp_group")) > 1 and call.get("cu_seqlens") is not None:
        # sbhd: RotaryEmbedding already gave this CP rank the freqs of its zigzag chunks; packed
        # sequences need megatron's per-sequence CP slicing of the freqs
        return "context parallel > 1 with packed sequences (thd)"
    mla = mla_interleaved(call)
    if mla and getattr(config, "rotary_interleaved", False):
        return "multi_latent_attention with rotary_interleaved"
    if freqs.requires_grad:
        return "freqs require grad"
    if not t.is_floating_point():
        return f"input dtype {t.dtype}"
    rot_dim = freqs.shape[-1]
    if freqs.dim() != 4 or rot_dim % 2 or rot_dim > t.shape[-1]:
        return f"freqs shape {tuple(freqs.shape)} for input {tuple(t.shape)}"
    if call["cu_seqlens"] is None:
        if t.dim() != 4 or freqs.shape[0] != t.shape[0] or freqs.shape[1] not in (1, t.shape[1]) or freqs.shape[2] != 1:
            return f"sbhd input {tuple(t.shape)} with freqs {tuple(freqs.shape)}"
    elif t.dim() != 3 or tuple(freqs.shape[1:3]) != (1, 1):
        return f"thd input {tuple(t.shape)} with freqs {tuple(freqs.shape)}"
    elif freqs.shape[0] == int(call["cu_seqlens"][-1]) and not per_token_thd_freqs:
        return "thd freqs with one row per packed token (megatron-core < 0.15 restarts each sequence at 0)"
    return None


@dataclass(frozen=True)
class FusedRope:
    """Wrapper of ``apply_rotary_pos_emb``.

    per_token_thd_freqs: megatron-core >= 0.15 maps packed token i to freqs row i when freqs has
    one row per token (earlier versions restart each sequence at row 0).
    """

    fall_back: Fallback
    per_token_thd_freqs: bool

    def __call__(self, wrapped, instance, args, kwargs):
        from mindspeed_like.kernels.rope import apply_rope

        call = Call(wrapped, args, kwargs)
        if (
            getattr(call["config"], "apply_rope_fusion", False)
            and transformer_engine.megatron_fused_rope() == "te-backend"
        ):
            # megatron's fused path is the te-backend's: TE's contract on this same kernel; nothing to hand back
            return wrapped(*args, **kwargs)
        reason = _unsupported(call, self.per_token_thd_freqs)
        if reason is not None:
            self.fall_back(reason)
            return wrapped(*args, **kwargs)
        config = call["config"]
        if mla_interleaved(call):
            mode = "mla"
        else:
            mode = "interleave" if getattr(config, "rotary_interleaved", False) else "half"
        return apply_rope(call["t"], call["freqs"], mode=mode, mscale=call["mscale"], cu_seqlens=call["cu_seqlens"])
