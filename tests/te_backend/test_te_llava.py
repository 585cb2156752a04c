"""LLaVA with sequence or context parallelism on the TE spec, without TransformerEngine.

megatron's ``LLaVAModel`` allows SP/CP only when the language spec's core attention is
``TEDotProductAttention`` and its module's ``HAVE_TE`` is true (plus ``is_te_min_version("1.10.0")``
for CP); without TE that stopped with "Sequence/Context Parallelism is supported only with TE
DotProductAttention" although the te-backend's attention was in the spec (te_backend/llava.py)."""

from __future__ import annotations

import sys

import pytest

import mindspeed_like
from mindspeed_like.te_backend import llava
from mindspeed_like.testing import destroy_parallel, init_parallel, run_distributed


def _layer_spec(local: bool):
    """A GPT layer spec whose parts can be edited: megatron-core 0.19 builds ``..._spec()`` from
    ``functools.partial`` submodules, so there the ``..._submodules()`` function's (megatron's test does so)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer

    name = "local" if local else "with_transformer_engine"
    submodules = getattr(specs, f"get_gpt_layer_{name}_submodules", None)
    if submodules is not None:
        return ModuleSpec(module=TransformerLayer, submodules=submodules())
    return getattr(specs, f"get_gpt_layer_{name}_spec")()


def _mlp_submodules(spec):
    from megatron.core.transformer import spec_utils

    get = getattr(spec_utils, "get_submodules", None)
    return get(spec.submodules.mlp) if get is not None else spec.submodules.mlp.submodules


def _llava(tp: int, cp: int, local: bool = False):
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    def config(hidden: int, **extra) -> TransformerConfig:
        return TransformerConfig(
            num_layers=1, hidden_size=hidden, num_attention_heads=4, tensor_model_parallel_size=tp, **extra
        )

    language = config(64, sequence_parallel=tp > 1, context_parallel_size=cp)
    language.language_model_type = "dummy"
    vision = config(16)
    vision.vision_model_type = "clip"
    spec = _layer_spec(local)
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.padding_causal
    return LLaVAModel(
        language_transformer_config=language,
        language_transformer_layer_spec=spec,
        language_vocab_size=128,
        language_max_sequence_length=64,
        vision_transformer_config=vision,
        vision_transformer_layer_spec=_layer_spec(local=False),
        drop_vision_class_token=False,
        vision_projection_config=config(64, ffn_hidden_size=128),
        vision_projection_layer_spec=_mlp_submodules(_layer_spec(local=False)),
        img_h=28,
        img_w=28,
        patch_dim=14,
    )


def _build(tp: int, cp: int, variant: str) -> str:
    """In each of 2 ranks: build LLaVA at TP ``tp`` (with SP) or CP ``cp``; ``variant``: 'te' (the TE spec),
    'local' (the local spec) or 'unpatched' (the TE spec, te_backend/llava.py's wrapper passing through).
    Returns 'built' or the AssertionError's text."""
    mindspeed_like.configure(device="cpu", transfer_to_host=True)
    init_parallel(tp=tp, context_parallel_size=cp)
    try:
        if variant == "unpatched":
            llava.TEAttentionAllowsParallelism.__call__ = lambda self, w, i, a, k: w(*a, **k)
        model = _llava(tp, cp, local=variant == "local")
        assert sys.modules[llava.LLAVA].HAVE_TE is False, "HAVE_TE is true only while LLaVA builds"
        assert model.sequence_parallel_lm == (tp > 1) and model.context_parallel_lm == cp
        return "built"
    except AssertionError as error:
        return str(error)
    finally:
        destroy_parallel()


REFUSED = "Sequence/Context Parallelism is supported only with TE DotProductAttention."


@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2)], ids=["tp2-sp", "cp2"])
def test_llava_with_sequence_or_context_parallelism_builds_on_the_backends_attention(tp, cp):
    assert run_distributed(_build, 2, tp, cp, "te", timeout=300) == ["built"] * 2
    assert run_distributed(_build, 2, tp, cp, "local", timeout=300) == [REFUSED] * 2  # megatron's check stays
    assert run_distributed(_build, 2, tp, cp, "unpatched", timeout=300) == [REFUSED] * 2
