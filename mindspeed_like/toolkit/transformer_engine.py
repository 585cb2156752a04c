"""Is TransformerEngine here, and can megatron build its TE layers and run its TE RoPE fusion?
Asked without being fooled by our own TE-compatible backend.

``installed()`` looks for a real ``transformer_engine`` package on ``sys.path`` (the path finder
only: a ``transformer_engine`` module our backend serves to clients through ``sys.meta_path`` is
not TE). ``megatron_te_layers_available()`` asks megatron itself whether its TE wrapper classes
are real classes (a real TE, or the te-backend's), rather than ``MagicMock`` stand-ins;
``megatron_fused_rope()`` whether its ``apply_rope_fusion`` has a function to call, and whose.
``rope_fusion_unavailable(args)`` is the one answer to "does Megatron-LM's default
``--apply-rope-fusion`` run here?" that its argument hooks share.
"""

from __future__ import annotations

import importlib.machinery
import sys


def installed() -> bool:
    """Whether a real TransformerEngine is importable (never our backend's client module)."""
    try:
        return importlib.machinery.PathFinder.find_spec("transformer_engine", sys.path) is not None
    except (ImportError, ValueError):
        return False


def megatron_te_layers_available() -> bool:
    """Whether ``megatron.core.extensions.transformer_engine.TELinear`` is a class (importing it)."""
    try:
        import megatron.core.extensions.transformer_engine as extension
    except ImportError:
        return False
    return isinstance(getattr(extension, "TELinear", None), type)


TE_BACKEND_ROPE = "mindspeed_like.te_backend.rope"


def megatron_fused_rope() -> str | None:
    """Who serves megatron's ``apply_rope_fusion`` (``rope_utils.fused_apply_rotary_pos_emb``, which
    megatron asserts is not None): ``"te-backend"`` (ours, TE 2.1's contract on our RoPE kernel),
    ``"transformer-engine"``, or None (megatron would fail "apply_rope_fusion is not available")."""
    try:
        from megatron.core.models.common.embeddings import rope_utils
    except ImportError:
        return None
    fused = getattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    if fused is None:
        return None
    return "te-backend" if getattr(fused, "__module__", None) == TE_BACKEND_ROPE else "transformer-engine"


def rope_fusion_unavailable(args) -> str | None:
    """Why Megatron-LM's ``apply_rope_fusion`` (on by default) cannot run here, or None when it can:
    with a real TransformerEngine (its kernels), or where the te-backend serves megatron's fused RoPE
    (rotate-half RoPE, sbhd and packed thd, context parallelism), except for what TE 2.1's fused RoPE,
    the API the te-backend implements, does not cover."""
    if installed():
        return None
    ours = "; ours: --use-fused-rotary-pos-emb"
    if megatron_fused_rope() is None:
        return "megatron's fused RoPE is TransformerEngine's, not installed, and the te-backend is off" + ours
    if getattr(args, "multi_latent_attention", False):
        return "multi-latent attention's fused RoPE is megatron's Triton kernel, not served by the te-backend" + ours
    if getattr(args, "rotary_interleaved", False):
        return "interleaved fused RoPE needs TransformerEngine >= 2.3; the te-backend serves TE 2.1's" + ours
    return None
