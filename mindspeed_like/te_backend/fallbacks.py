"""TE-only config switches whose unfused path in megatron is the same math: switched off, said once.

``moe_permute_fusion`` asks for TE's fused token permutation (``fused_permute`` & co., taken by
``moe_utils`` from the TE extension module only when TE imports); without TE megatron's
``TransformerConfig.__post_init__`` fails importing them. Clients set it in code (Megatron-Bridge's
Qwen3-MoE bridge sets ``moe_permute_fusion = True`` unconditionally), so it cannot be refused on a
command line: the wrapper turns it off before megatron validates (megatron's unfused ``permute`` /
``unpermute`` give the same tokens in the same order), logged once, an error under ``--strict``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed_like.toolkit.fallback import Fallback


@dataclass(frozen=True)
class TransformerConfigFallbacks:
    """Wrapper of ``TransformerConfig.__post_init__``."""

    fallback: Fallback

    def __call__(self, wrapped, instance, args, kwargs):
        if instance is not None and getattr(instance, "moe_permute_fusion", False) and not _fused_permute_available():
            self.fallback(
                "moe_permute_fusion asks for TransformerEngine's fused token permutation, which is not available "
                "without TransformerEngine; switched off (megatron's unfused permute: the same tokens, same order)"
            )
            instance.moe_permute_fusion = False
        return wrapped(*args, **kwargs)


def _fused_permute_available() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return getattr(moe_utils, "fused_permute", None) is not None
