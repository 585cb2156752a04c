"""``--attention-backend`` (megatron's ``AttnBackend``: which TE attention kernel) on the TE-spec model:
what each choice runs here, and the argument-time check of what cannot be honoured.

A module of its own, importing megatron only inside functions: Megatron-LM's validate_args hook
runs it before megatron's attention module may have been imported, and importing that module
installs te-backend's PROVIDE patches, which import ``te_backend.attention``; the check living in
that module made the first import circular.
"""

from __future__ import annotations

import functools
from typing import Any

from mindspeed_like.te_backend.refusals import TransformerEngineFeatureUnsupported
from mindspeed_like.toolkit.errors import LevelConflict

ATTENTION_BACKENDS = {
    "flash": "our flash kernel (flash-attention's; with --use-flash-attn's knobs when it is on)",
    "fused": "our attention: the flash kernel when flash-attention is on, else megatron's math",
    "auto": "our attention: the flash kernel when flash-attention is on, else megatron's math",
    "unfused": "megatron's own math (DotProductAttention: scores, masked softmax, probs @ V)",
}
"""``--attention-backend`` (megatron's ``AttnBackend``, TE's kernel choice) -> what runs here."""


def _backend_name(value: Any) -> str:
    return getattr(value, "name", None) or str(value or "auto")


def flash_attention_on() -> bool:
    """Whether flash-attention's wrapper is in ``DotProductAttention.forward``'s wrapper chain."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from mindspeed_like.engine import wrappers_of
    from mindspeed_like.features.flash_attention.forward import FlashAttentionForward

    return any(isinstance(w, FlashAttentionForward) for w in wrappers_of(DotProductAttention.__dict__.get("forward")))


@functools.cache
def _flash_forward():
    """flash-attention's wrapper with its default knobs, for ``--attention-backend flash`` while
    the feature is off; a call it cannot take goes to megatron's math, logged once."""
    from mindspeed_like.features.flash_attention.forward import (
        CausalShape,
        FlashAttentionForward,
        FlashAttentionUnsupported,
    )
    from mindspeed_like.toolkit.fallback import Fallback

    fallback = Fallback("te-backend", False, FlashAttentionUnsupported, "--attention-backend flash: megatron's math")
    return FlashAttentionForward(CausalShape(), fallback)


def check_attention_backend(args: Any) -> None:
    """validate_args: Megatron-LM's ``--attention-backend`` with the TE-spec model, refused where it
    cannot be honoured (a ``LevelConflict`` lets a feature that only ``--optimization-level``
    switched on step aside instead)."""
    if getattr(args, "transformer_impl", None) != "transformer_engine":
        return
    backend = _backend_name(getattr(args, "attention_backend", None))
    if backend == "local":
        raise TransformerEngineFeatureUnsupported(
            "mindspeed_like te-backend: --attention-backend local asks for megatron's local core attention "
            "(--spec local), but --transformer-impl transformer_engine builds TEDotProductAttention; use "
            "--transformer-impl local for it, or --attention-backend auto|flash|fused|unfused "
            f"({', '.join(f'{k}: {v}' for k, v in ATTENTION_BACKENDS.items())})"
        )
    if backend == "unfused":
        if getattr(args, "context_parallel_size", 1) > 1:
            raise TransformerEngineFeatureUnsupported(
                "mindspeed_like te-backend: --attention-backend unfused (megatron's math) has no context "
                "parallelism; with --context-parallel-size > 1 use --attention-backend auto (context-parallel's "
                "kernels)"
            )
        if flash_attention_on():
            raise LevelConflict(
                "flash-attention",
                "--attention-backend unfused",
                "mindspeed_like te-backend: --attention-backend unfused asks for megatron's math, --use-flash-attn "
                "for our flash kernel; drop one (--attention-backend flash is the flash kernel)",
            )
