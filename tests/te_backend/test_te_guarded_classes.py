"""megatron's classes that exist only with TE (defined under ``if HAVE_TE:`` on TE's wrappers) on the
te-backend: ``TELayerNormColumnParallelLinearGathered``, which a heterogeneous GPT's TE spec builds for an
attention or MLP "replaced with a linear" (Nemotron-NAS style block configs). Without it the spec held None
and ``build_module`` failed ("cannot unpack non-iterable NoneType object"; megatron's own
models/test_heterogeneous_gpt_model.py, 4 tests at every level)."""

from __future__ import annotations

import json

import pytest
import torch

from mindspeed_like.testing import init_parallel
from mindspeed_like.testing.parity import SEED

HIDDEN, HEADS, VOCAB, SEQ = 64, 4, 128, 8
FIRST = {
    "attention": {"no_op": False, "replace_with_linear": False, "num_query_groups": 2},
    "mlp": {"no_op": False, "replace_with_linear": False, "ffn_hidden_size": 128},
}


def _model(tmp_path, use_te: bool, replace: str):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

    second = json.loads(json.dumps(FIRST))
    second[replace].update(replace_with_linear=True)
    if replace == "attention":
        second["attention"]["num_query_groups"] = None
    else:
        second["mlp"]["ffn_hidden_size"] = None
    path = tmp_path / f"blocks-{use_te}.json"
    path.write_text(json.dumps({"block_configs": [FIRST, second]}))
    config = HeterogeneousTransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        add_bias_linear=False,
        normalization="RMSNorm",
        gated_linear_unit=True,
        use_cpu_initialization=True,
        heterogeneous_layers_config_path=str(path),
    )
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    spec = get_gpt_heterogeneous_layer_spec(config, use_te=use_te)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")


@pytest.mark.parametrize("replace", ["attention", "mlp"])
def test_a_block_replaced_with_a_linear_builds_on_the_te_spec_as_on_the_local_one(cpu_config, tmp_path, replace):
    from megatron.core.transformer.heterogeneous import linear_replacements

    cpu_config()
    init_parallel(seed=SEED)
    te_model = _model(tmp_path, use_te=True, replace=replace)
    local = _model(tmp_path, use_te=False, replace=replace)
    gathered = [m for m in te_model.modules() if type(m).__name__ == "TELayerNormColumnParallelLinearGathered"]
    assert len(gathered) == 1 and isinstance(gathered[0], linear_replacements.TELayerNormColumnParallelLinearGathered)
    assert sum(p.numel() for p in te_model.parameters()) == sum(p.numel() for p in local.parameters())

    # the same function: the TE spec's fused norm+linear against the local spec's norm, then linear
    te_state = te_model.state_dict()
    mapped = {}
    for name, value in local.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        candidates = [  # the TE spec folds each norm into the linear after it (the replacing one too)
            name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
            name.replace("input_layernorm.weight", "self_attention.layer_norm_weight"),
            name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
            name.replace("pre_mlp_layernorm.weight", "mlp.layer_norm_weight"),
        ]
        mapped[next((c for c in candidates if c in te_state), name)] = value
    missing = set(k for k in te_state if not k.endswith("_extra_state")) - set(mapped)
    assert not missing, sorted(missing)
    te_model.load_state_dict(mapped, strict=False)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(SEED))
    position_ids = torch.arange(SEQ).expand(2, SEQ)
    te_model.eval(), local.eval()  # megatron's default dropouts
    with torch.no_grad():
        want = local(tokens, position_ids, None)
        got = te_model(tokens, position_ids, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
