"""Explicit composition (mindspeed_like.specs): our modules in a megatron-core GPT spec, without
patching megatron for those features; same results as the patched path and as megatron's."""

from __future__ import annotations

import pytest

import mindspeed_like
from mindspeed_like import ConfigError
from mindspeed_like.testing import destroy_parallel, gpt_config, init_parallel, tiny_gpt, train_steps
from mindspeed_like.testing.parity import SEED

FLAGS = dict(use_flash_attn=True, use_fused_rmsnorm=True, use_fused_swiglu=True, recompute_activation_function=True)


@pytest.fixture
def cpu_only():
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")  # device bring-up only: no feature patches
    yield
    destroy_parallel()
    mindspeed_like.reset()


def _spec_gpt(**flags):
    from megatron.core.models.gpt import GPTModel

    from mindspeed_like.specs import gpt_block_spec

    init_parallel(seed=SEED)
    config = gpt_config()
    return GPTModel(
        config=config,
        transformer_layer_spec=gpt_block_spec(config, **flags),
        vocab_size=256,
        max_sequence_length=32,
        position_embedding_type="rope",
    )


def test_spec_modules_are_ours_and_nothing_is_patched(cpu_only):
    from mindspeed_like.features.fused_rmsnorm import FusedRMSNorm

    model = _spec_gpt(**FLAGS)
    layer = model.decoder.layers[0]
    assert isinstance(layer.input_layernorm, FusedRMSNorm) and isinstance(model.decoder.final_layernorm, FusedRMSNorm)
    assert type(layer.self_attention.core_attention).__name__ == "FlashDotProductAttention"
    assert type(layer.mlp).__name__ == "ComposedMLP"
    patched = {r.feature for r in mindspeed_like.report()}
    assert patched.isdisjoint({"flash-attention", "fused-rmsnorm", "fused-swiglu", "recompute-activation-function"})


def test_spec_training_equals_the_patched_features_and_megatron(cpu_only):
    spec_losses = train_steps(_spec_gpt(**FLAGS), 5, seed=SEED)
    destroy_parallel()
    plain_losses = train_steps(_plain(), 5, seed=SEED)
    destroy_parallel()
    mindspeed_like.configure(**FLAGS)
    patched_losses = train_steps(_plain(), 5, seed=SEED)
    assert spec_losses == patched_losses  # the same kernels, reached without patches: bitwise
    assert max(abs(a - b) / abs(b) for a, b in zip(spec_losses, plain_losses)) < 1e-5


def _plain():
    init_parallel(seed=SEED)
    return tiny_gpt()


def test_unrequested_modules_stay_megatrons(cpu_only):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.mlp import MLP

    model = _spec_gpt(use_fused_rmsnorm=True)
    layer = model.decoder.layers[0]
    assert type(layer.self_attention.core_attention) is DotProductAttention and type(layer.mlp) is MLP


def test_bad_flags_are_config_errors(cpu_only):
    from mindspeed_like.specs import gpt_layer_spec

    with pytest.raises(ConfigError, match="expected bool"):
        gpt_layer_spec(use_flash_attn="yes")
    with pytest.raises(ConfigError, match="--sparse-mode 7"):
        gpt_layer_spec(use_flash_attn=True, sparse_mode=7)
    with pytest.raises(ConfigError, match="use_flash_atn"):
        gpt_layer_spec(use_flash_atn=True)


def test_provider_follows_megatrons_backend_protocol(cpu_only):
    from megatron.core.models.backends import LocalSpecProvider

    from mindspeed_like.specs import MindSpeedSpecProvider

    provider = MindSpeedSpecProvider(use_flash_attn=True)
    local = LocalSpecProvider()
    assert provider.column_parallel_linear() is local.column_parallel_linear()
    assert provider.core_attention().__name__ == "FlashDotProductAttention"
    assert provider.layer_norm(rms_norm=True) is local.layer_norm(rms_norm=True)


def test_per_layer_recompute_selection_records_layer_numbers(cpu_only):
    from mindspeed_like.features.recompute_activation.layers import STAGE_LAYER_ATTR

    model = _spec_gpt(recompute_activation_function=True, recompute_activation_function_num_layers=1)
    assert [getattr(layer.mlp, STAGE_LAYER_ATTR) for layer in model.decoder.layers] == [1, 2]
    assert type(model.decoder.layers[0]).__name__ == "NumberedTransformerLayer"
    losses = train_steps(model, 2, seed=SEED)
    destroy_parallel()
    assert losses == train_steps(_plain(), 2, seed=SEED)
