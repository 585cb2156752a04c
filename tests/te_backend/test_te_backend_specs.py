"""Every megatron spec that asks for TransformerEngine builds and trains on the te-backend, without
TE: ``get_gpt_decoder_block_spec(use_transformer_engine=True)`` (what verl, mbridge and mcore-bridge
call; dense, MoE, MLA), the MTP block spec, ``get_moe_module_spec(use_te=True)`` and, on the
releases that have it (0.18+), HybridModel's ``hybrid_stack_spec`` with an attention / MLP / MoE
pattern. Each model learns one batch (the loss falls), so a model that does not train cannot pass.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import mindspeed_like
from mindspeed_like.testing import destroy_parallel, init_parallel
from mindspeed_like.testing.models import gpt_config
from mindspeed_like.testing.parity import SEED

VOCAB, SEQ = 128, 32


@pytest.fixture
def te_backend():
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    init_parallel(seed=SEED)
    yield
    destroy_parallel()
    mindspeed_like.reset()


def _learns(model: torch.nn.Module, steps: int = 4, **forward) -> list[float]:
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    positions = torch.arange(SEQ).expand(2, SEQ)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(tokens, positions, None, labels=tokens, **forward).float().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses
    return losses


def _te_classes(model: torch.nn.Module) -> set[str]:
    return {type(m).__name__ for m in model.modules() if type(m).__module__.startswith("mindspeed_like.te_backend")}


@pytest.mark.parametrize(
    "model_args",
    [
        dict(qk_layernorm=True, num_query_groups=2),
        dict(num_moe_experts=4, moe_grouped_gemm=True),
        dict(multi_latent_attention=True),
    ],
    ids=["dense", "moe-grouped", "mla"],
)
def test_decoder_block_spec_with_transformer_engine(te_backend, model_args):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = gpt_config(**model_args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    assert {"TELayerNormColumnParallelLinear", "TERowParallelLinear", "TEDotProductAttention"} & _te_classes(model)
    _learns(model)


def test_mtp_block_spec_with_transformer_engine(te_backend):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
        get_gpt_mtp_block_spec,
    )

    config = gpt_config(mtp_num_layers=1, mtp_loss_scaling_factor=0.1)  # Megatron-LM's default (0.13 has none)
    layer = get_gpt_layer_with_transformer_engine_spec()
    mtp = get_gpt_mtp_block_spec(config, layer, use_transformer_engine=True)
    model = GPTModel(
        config=config, transformer_layer_spec=layer, vocab_size=VOCAB, max_sequence_length=SEQ, mtp_block_spec=mtp
    )
    assert any(name.startswith("mtp.layers.0.") for name, _ in model.named_parameters())
    _learns(model)


def test_moe_module_spec_with_te(te_backend):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    config = gpt_config(num_moe_experts=4, moe_grouped_gemm=True, moe_router_topk=2)
    spec = get_moe_module_spec(use_te=True, num_experts=4, moe_grouped_gemm=True)
    # a ModuleSpec up to 0.18; from 0.19 a builder (functools.partial of MoELayer)
    layer = build_module(spec, config=config) if isinstance(spec, ModuleSpec) else spec(config=config)
    names = {name for name, _ in layer.named_parameters()}
    assert {f"experts.linear_fc1.weight{e}" for e in range(4)} <= names
    x = torch.randn(SEQ, 2, config.hidden_size, requires_grad=True)
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.skipif(
    importlib.util.find_spec("megatron.core.models.hybrid") is None,
    reason="HybridModel (megatron.core.models.hybrid) exists from megatron-core 0.18; the version lane runs 0.19.2",
)
def test_hybrid_model_with_attention_mlp_and_moe_layers(te_backend):
    """0.19 deprecates GPTModel for HybridModel, whose specs import only TE classes: ``*`` attention,
    ``-`` MLP, ``E`` MoE (grouped experts), with qk-layernorm and GQA."""
    from megatron.core.models.hybrid import hybrid_layer_specs
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    config = gpt_config(
        num_layers=4, num_moe_experts=4, moe_grouped_gemm=True, moe_router_topk=2, qk_layernorm=True, num_query_groups=2
    )
    model = HybridModel(
        config=config,
        hybrid_stack_spec=hybrid_layer_specs.hybrid_stack_spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        hybrid_layer_pattern="*-*E",
        position_embedding_type="rope",
    )
    names = {name for name, _ in model.named_parameters()}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.3.mlp.experts.linear_fc1.weight3" in names
    _learns(model)


def test_te_attention_never_asks_for_megatrons_compiled_softmax(te_backend):
    """Issue 37 9b: a client's ``masked_softmax_fusion=True`` (mbridge's, verl's) in bf16 made the TE
    attention run megatron's local softmax through ``scaled_masked_softmax_cuda``, a compiled extension
    TE never uses (ModuleNotFoundError here and on GPUs without megatron's kernels). It computes megatron's
    softmax in torch: bitwise megatron's local attention with the fusion off."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mindspeed_like.te_backend.attention import TEDotProductAttention

    fused = gpt_config(bf16=True, masked_softmax_fusion=True)
    te = TEDotProductAttention(fused, 1, AttnMaskType.causal, "self")
    local = DotProductAttention(gpt_config(bf16=True, masked_softmax_fusion=False), 1, AttnMaskType.causal, "self")
    heads, dim = fused.num_attention_heads, fused.kv_channels
    # the shape megatron's fused kernel accepts (16 < seq <= 4096, seq and batch x heads divisible by 4)
    q, k, v = torch.randn(3, SEQ, 4, heads, dim, generator=torch.Generator().manual_seed(SEED)).bfloat16().unbind(0)
    # not asked for at all, so also where the extension is installed (TE would not use it there either);
    # where it is absent, fixes/masked_softmax_without_extension.py covers megatron's own local attention
    assert te.scale_mask_softmax.scaled_masked_softmax_fusion is False
    assert torch.equal(te(q, k, v, None), local(q, k, v, None))
