"""The deepseek and qwen3-moe presets: the model each builds (both layer specs), and both compare arms
training the same function at level 0 (megatron's own path in both: equal losses, step by step)."""

from __future__ import annotations

import json
import os

import pytest

from mindspeed_like.cli import main
from mindspeed_like.compare.presets import PRESETS

TINY = ["--steps", "2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
TINY += ["--seq-length", "16", "--micro-batch-size", "2", "--quiet", "--repeats", "1"]


def _compare(tmp_path, *args: str) -> dict:
    out = str(tmp_path / "out")
    assert main(["compare", *TINY, "--out", out, *args]) == 0
    with open(os.path.join(out, "compare.json")) as handle:
        return json.load(handle)["compare"]


def test_deepseek_preset_maps_megatron_lm_flags_to_config_fields():
    args = PRESETS["deepseek"].model_args(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256)
    assert args["multi_latent_attention"] and args["qk_layernorm"]
    assert (args["q_lora_rank"], args["kv_lora_rank"]) == (64, 32)
    assert (args["qk_head_dim"], args["qk_pos_emb_head_dim"], args["v_head_dim"]) == (32, 16, 32)
    assert args["rope_type"] == "yarn" and args["rotary_scaling_factor"] == 40.0
    assert args["moe_layer_freq"] == [0, 1, 1, 1]  # first layer dense
    assert args["moe_router_score_function"] == "sigmoid" and args["moe_router_enable_expert_bias"]
    assert (args["num_moe_experts"], args["moe_router_num_groups"], args["moe_router_group_topk"]) == (8, 4, 2)
    assert args["moe_shared_expert_intermediate_size"] == args["moe_ffn_hidden_size"] == 64
    assert args["mtp_num_layers"] == 1 and args["moe_grouped_gemm"]
    # one layer: MoE (the preset is about the MoE parts)
    assert PRESETS["deepseek"].model_args(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16)[
        "moe_layer_freq"
    ] == [1]


def test_qwen3_moe_and_moe_presets_ask_for_grouped_gemm_like_megatron_lm_examples():
    qwen = PRESETS["qwen3-moe"].model_args(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256)
    assert qwen["qk_layernorm"] and qwen["num_query_groups"] == 2
    assert (qwen["num_moe_experts"], qwen["moe_router_topk"], qwen["moe_ffn_hidden_size"]) == (8, 2, 96)
    assert qwen.get("moe_router_pre_softmax", False) is False  # softmax over the top-k: normalized probs
    assert "moe_shared_expert_intermediate_size" not in qwen and qwen["moe_grouped_gemm"]
    assert PRESETS["moe"].model_args(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16)[
        "moe_grouped_gemm"
    ]


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_deepseek_builds_mla_yarn_dense_first_layer_shared_experts_and_mtp(adapter, impl):
    from mindspeed_like.testing import tiny_gpt

    args = PRESETS["deepseek"].model_args(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
    model = tiny_gpt(wrap_float16=False, transformer_impl=impl, **args)
    layers = model.decoder.layers
    assert type(layers[0].self_attention).__name__ == "MLASelfAttention"
    assert type(layers[0].self_attention.rotary_pos_emb).__name__ == "YarnRotaryEmbedding"
    assert type(layers[0].mlp).__name__ == "MLP" and type(layers[1].mlp).__name__ == "MoELayer"
    moe = layers[1].mlp
    assert moe.shared_experts is not None
    assert moe.router.config.moe_router_num_groups == 4 and moe.router.expert_bias is not None
    expected_experts = "TEGroupedMLP" if impl == "transformer_engine" else ("GroupedMLP", "SequentialMLP")
    assert type(moe.experts).__name__ in expected_experts
    assert len(model.mtp.layers) == 1
    # the MTP layer's transformer layer (``transformer_layer``; renamed in megatron-core 0.19) is the decoder's last
    assert any(type(m).__name__ == "MoELayer" for m in model.mtp.layers[0].modules())
    assert any(type(m).__name__ == "MLASelfAttention" for m in model.mtp.layers[0].modules())


@pytest.mark.slow
def test_deepseek_level_0_arms_train_the_same_function(tmp_path):
    """Level 0 (megatron's path in both arms) on the default TE spec: the preset builds the same model
    in both processes, so the losses are equal step for step."""
    result = _compare(tmp_path, "--preset", "deepseek", "--optimization-level", "0")
    assert result["model"]["preset"] == "deepseek"
    assert result["megatron"]["losses"] == result["with_features"]["losses"]


@pytest.mark.slow
def test_qwen3_moe_level_0_arms_train_the_same_function(tmp_path):
    result = _compare(tmp_path, "--preset", "qwen3-moe", "--optimization-level", "0", "--transformer-impl", "local")
    assert result["megatron"]["losses"] == result["with_features"]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "impl"), [("deepseek", "local"), ("qwen3-moe", "transformer_engine"), ("moe", "transformer_engine")]
)
def test_other_impl_level_0_arms_train_the_same_function(tmp_path, preset, impl):
    result = _compare(tmp_path, "--preset", preset, "--optimization-level", "0", "--transformer-impl", impl)
    assert result["megatron"]["losses"] == result["with_features"]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["deepseek", "qwen3-moe"])
@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_level_2_trains_close_to_megatron_with_grouped_gemm(tmp_path, preset, impl):
    """Level 2 (bf16): the features run (grouped GEMM among them) and the losses stay within bf16 noise
    of megatron's (measured: <= 1.2e-4 over 2 steps at this size)."""
    result = _compare(tmp_path, "--preset", preset, "--optimization-level", "2", "--transformer-impl", impl)
    assert result["loss"]["first_step_equal"] or result["loss"]["max_abs_diff"] < 5e-3
    assert result["loss"]["max_abs_diff"] < 5e-3
    assert {"grouped-gemm", "flash-attention", "moe-permute"} <= set(result["features"]["ran"])


def test_deepseek_head_dim_too_small_is_a_clear_error(tmp_path, capsys):
    code = main(["compare", "--preset", "deepseek", "--hidden-size", "24", "--num-attention-heads", "8"])
    assert code == 2
    assert "--preset deepseek needs hidden-size / num-attention-heads even and >= 4" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["deepseek", "qwen3-moe"])
def test_te_spec_model_gets_the_local_spec_weights(adapter, preset):
    """Both ``--transformer-impl`` choices start from the same function: the TE-spec model takes the
    local-spec model's weights by checkpoint key (MLA's qk norms included, which megatron's local spec
    names differently), so the per-token losses agree to fp32 rounding (sums in another order)."""
    import torch

    from mindspeed_like.compare.worker import _build_model

    spec = dict(
        preset=preset,
        size=dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16),
        bf16=False,
        sp=False,
        seed=1234,
        tp=1,
        ep=1,
    )
    losses = {}
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(16).unsqueeze(0).expand(2, 16)
    for impl in ("local", "transformer_engine"):
        model = _build_model(dict(spec, transformer_impl=impl), grouped_gemm_on=False)
        with torch.no_grad():
            losses[impl] = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:])
    torch.testing.assert_close(losses["transformer_engine"], losses["local"], rtol=1e-5, atol=1e-5)
