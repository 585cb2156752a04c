"""megatron's CLIP ViT encoder (and LLaVA/MIMO, which build it) without TransformerEngine: its
norm default is torch's LayerNorm, which takes no ``config=`` (TypeError at construction); with
the te-backend it gets the te-backend's TENorm, as megatron does with TE installed."""

from __future__ import annotations

import pytest
import torch

import mindspeed_like
from mindspeed_like import runtime
from mindspeed_like.testing import destroy_parallel, init_parallel


def _clip():
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True)
    return CLIPViTModel(config, get_vit_layer_with_transformer_engine_spec(), img_h=32, img_w=32, patch_dim=16)


@pytest.fixture
def on_cpu():
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", transfer_to_host=True)  # CLIPViTModel calls .cuda() itself
    init_parallel()
    yield
    destroy_parallel()
    mindspeed_like.reset()


def test_clip_vit_builds_and_runs_with_the_backends_norm(on_cpu):
    model = _clip()  # TENorm builds TE's LayerNorm/RMSNorm class by config, as TE's factory does
    assert type(model.ln_pre).__module__.startswith("mindspeed_like.te_backend"), type(model.ln_pre)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape[-1] == 64 and torch.isfinite(out).all()
    runtime.ENGINE.remove("te-backend")  # megatron's own fallback
    with pytest.raises(TypeError, match="unexpected keyword argument 'config'"):
        _clip()
