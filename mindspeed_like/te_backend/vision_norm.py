"""megatron's CLIP ViT encoder takes its norm class at import: TE's ``TENorm`` where TE imports,
else ``torch.nn.LayerNorm`` (``models/vision/clip_vit_model.py``'s ``NORM_IMPL``, 0.13-0.19).

That fallback is unusable: ``CLIPViTModel.__init__`` builds its ``ln_pre``/``ln_post`` with
``build_module(..., config=..., hidden_size=..., eps=...)``, and torch's LayerNorm takes no
``config`` (``TypeError: LayerNorm.__init__() got an unexpected keyword argument 'config'``: every
CLIP, LLaVA and MIMO model without TE, megatron's own tests among them). The name is bound as a
default argument, so providing it in the module after import would not reach the constructor.

Where the te-backend serves TE's layers, the constructor gets the te-backend's ``TENorm`` in place
of that fallback (what megatron takes with TE installed): only when the argument is
``torch.nn.LayerNorm`` and the module chose it as its fallback, a class megatron's build could not
have constructed; a spec or any other class the caller gives is left alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from mindspeed_like.toolkit.binding import Call

CLIP_VIT = "megatron.core.models.vision.clip_vit_model"


@dataclass(frozen=True)
class NormFromTheBackend:
    """Wrapper of ``CLIPViTModel.__init__``."""

    def __call__(self, wrapped, instance, args, kwargs):
        module = sys.modules.get(CLIP_VIT)
        if getattr(module, "NORM_IMPL", None) is not torch.nn.LayerNorm:  # TE's TENorm was bound at import
            return wrapped(*args, **kwargs)
        from mindspeed_like.te_backend.classes import TENorm

        call = Call(wrapped, args, kwargs)
        changes = {
            name: TENorm
            for name in ("ln_pre_impl", "ln_post_impl")
            if name in call and call[name] is torch.nn.LayerNorm
        }
        return call(**changes)
