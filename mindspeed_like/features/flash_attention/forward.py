"""flash-attention's mechanism: megatron-core's local-spec core attention through a flash kernel,
with MindSpeed's knobs ``--sparse-mode``, ``--pre-tockens`` and ``--next-tockens`` for causal layers.

Target: ``megatron.core.transformer.dot_product_attention.DotProductAttention.forward`` (WRAP).
``DotProductAttention`` is what the local spec (and the T5/BERT/LLaVA/ViT specs, and
``models.bert.bert_model.MCoreDotProductAttention``) build as ``core_attention``; those modules
hold the class by name, and a method patched on the class reaches every alias. ``forward`` is
the one place that sees q/k/v, the mask, the packed-sequence parameters and the module's
resolved settings (``softmax_scale``, layer scaling, window, dropout); patching deeper
(``FusedScaleMaskSoftmax``) would still leave the two O(s^2) matmuls. A WRAP, so megatron's own
``forward`` stays underneath for the calls handed back to it.

Megatron's semantics reproduced (its ``forward_torch_softmax`` path):
- mask: the caller's mask (True = masked out) is used as given; without one, a causal layer
  (``AttnMaskType.causal``) is causal when ``sq > 1``, other types attend everywhere. A given
  mask that IS the causal mask (checked once per mask tensor) becomes ``is_causal``, so GPT
  training never materializes it. With ``config.window_size`` on this layer, the sliding-window
  band replaces every other mask, as in megatron. Fully masked rows: megatron's uniform average.
- scale: ``softmax_scale`` times the softmax's own ``scale`` (``apply_query_key_layer_scaling``
  divides by the layer number and the softmax multiplies it back: the same net scale).
- GQA: k/v with ``num_query_groups`` heads go to the kernel unexpanded.
- dropout: ``attention_dropout.p`` while training, inside ``get_cuda_rng_tracker().fork()``
  unless sequence parallel (the same RNG stream megatron uses; masks differ bit for bit).
- output ``[sq, b, heads * head_dim]`` (packed: ``[t, heads * head_dim]``, which ``Attention``
  reshapes as it does for TransformerEngine).
Beyond megatron's local path: packed sequences (``PackedSeqParams`` with ``qkv_format='thd'``,
per-sequence attention, causal per sequence), and causal attention with ``sq != sk``
(bottom-right, where megatron asserts ``sq == sk``).
Handed back to megatron (one log line per reason; an error under ``strict``): ``attention_bias``,
``softmax_type`` other than vanilla, a non-boolean ``attention_mask``, packed formats other than
thd or with padded cu_seqlens that differ from the real ones, an ``attention_mask`` together with
packed sequences.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.errors import FeatureUnsupported
from mindspeed_like.toolkit.fallback import Fallback


class FlashAttentionUnsupported(FeatureUnsupported):
    """``strict`` is on and a call cannot use flash attention."""


@dataclass(frozen=True)
class CausalShape:
    """MindSpeed's knobs for causal layers (see the flags' help)."""

    sparse_mode: int = 0
    pre_tockens: int = 65536
    next_tockens: int = 0


def _unsupported(instance, call: Call) -> str | None:
    if call.get("attention_bias") is not None:
        return "attention_bias is given"
    if getattr(instance, "softmax_offset", None) is not None:
        return f"softmax_type {getattr(instance.config, 'softmax_type', '?')!r}"
    mask = call["attention_mask"]
    if mask is not None and mask.dtype != torch.bool:
        return f"attention_mask of dtype {mask.dtype} (megatron's masks are bool, True = masked out)"
    packed = call.get("packed_seq_params")
    if packed is not None:
        if packed.qkv_format != "thd":
            return f"packed_seq_params with qkv_format {packed.qkv_format!r}"
        for name in ("q", "kv"):
            padded = getattr(packed, f"cu_seqlens_{name}_padded", None)
            real = getattr(packed, f"cu_seqlens_{name}")
            if padded is not None and (real is None or not torch.equal(padded.cpu(), real.cpu())):
                return "padded cu_seqlens that differ from the real ones"
        if call["attention_mask"] is not None:
            return "an attention_mask together with packed sequences"
    return None


# ---------------------------------------------------------------- masks


_causal_seen: list = []  # [(weakref to mask, its _version, verdict)]


def _is_causal_mask(mask: torch.Tensor, sq: int, sk: int) -> bool:
    """Whether ``mask`` (True = masked out) is exactly megatron's causal mask, once per tensor."""
    if _causal_seen:
        ref, version, verdict = _causal_seen[0]
        if ref() is mask and version == mask._version:
            return verdict
    verdict = False
    if mask.dtype == torch.bool and mask.dim() >= 2 and tuple(mask.shape[-2:]) == (sq, sk) and sq == sk:
        expected = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=mask.device), diagonal=1)
        verdict = bool(torch.equal(mask, expected.expand_as(mask)))
    _causal_seen[:] = [(weakref.ref(mask), mask._version, verdict)]
    return verdict


def _causal_band(shape: CausalShape, sq: int, sk: int):
    """The causal band for a causal layer, shaped by MindSpeed's knobs (see the flag help)."""
    from mindspeed_like.kernels.flash_attention import Band

    mode = shape.sparse_mode
    if mode == 2:
        return Band(None, 0, bottom_right=False)
    if mode == 3:
        return Band(None, 0, bottom_right=True)
    if mode == 4:
        return Band(shape.pre_tockens, shape.next_tockens, bottom_right=True)
    return Band(shape.pre_tockens, 0, bottom_right=True)


def _window_band(window):
    from mindspeed_like.kernels.flash_attention import Band

    left, right = window
    return Band(None if left is None or left < 0 else int(left), None if right is None or right < 0 else int(right))


def _mask_args(instance, call: Call, shape: CausalShape, sq: int, sk: int) -> dict:
    """``mask`` / ``band`` for the kernel, reproducing megatron's choice of mask."""
    from megatron.core.transformer.enums import AttnMaskType

    window = getattr(instance.scale_mask_softmax, "window_size", None)
    if window is not None:
        return dict(band=_window_band(window))
    causal = instance.attn_mask_type == AttnMaskType.causal
    mask = call["attention_mask"]
    if call.get("packed_seq_params") is not None:
        padding_causal = getattr(AttnMaskType, "padding_causal", None)
        is_causal = causal or (padding_causal is not None and instance.attn_mask_type == padding_causal)
        return dict(band=_causal_band(shape, sq, sk) if is_causal else None)
    if mask is not None:
        if causal and _is_causal_mask(mask, sq, sk):
            return dict(band=_causal_band(shape, sq, sk))
        return dict(mask=mask)
    if causal and sq > 1:
        return dict(band=_causal_band(shape, sq, sk))
    return {}


# ---------------------------------------------------------------- forward


@dataclass(frozen=True)
class FlashAttentionForward:
    """Wrapper of ``DotProductAttention.forward``."""

    shape: CausalShape
    fall_back: Fallback
    pad_value_head: bool = True  # CPU, V head dim != q/k's: pad for the fused kernel (False: blocked kernel)

    def __call__(self, wrapped, instance, args, kwargs):
        from mindspeed_like.kernels.flash_attention import flash_attention

        if instance is None:
            return wrapped(*args, **kwargs)
        call = Call(wrapped, args, kwargs)
        reason = _unsupported(instance, call)
        if reason is not None:
            self.fall_back(reason)
            return wrapped(*args, **kwargs)
        query, key, value = call["query"], call["key"], call["value"]
        packed = call.get("packed_seq_params")
        sq, sk = query.shape[0], key.shape[0]
        kernel_args = _mask_args(instance, call, self.shape, sq, sk)
        if packed is not None:
            kernel_args.update(cu_seqlens_q=packed.cu_seqlens_q, cu_seqlens_kv=packed.cu_seqlens_kv)
        scale = instance.softmax_scale * (instance.scale_mask_softmax.scale or 1.0)
        dropout = instance.attention_dropout
        p = float(dropout.p) if dropout.training else 0.0
        fork = contextlib.nullcontext()
        if p > 0 and not instance.config.sequence_parallel:
            from megatron.core import tensor_parallel

            fork = tensor_parallel.get_cuda_rng_tracker().fork()
        with fork:
            return flash_attention(
                query, key, value, scale=scale, dropout_p=p, pad_value_head=self.pad_value_head, **kernel_args
            )
