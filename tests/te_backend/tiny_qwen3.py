"""Tiny random HF Qwen3 / Qwen3-MoE models: the clients' tests (Megatron-Bridge, mbridge) convert
these. Imported by the test modules and by their spawned workers (the test folder is on the path)."""

import torch

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)


def hf_model(kind: str):
    """``qwen3`` or ``qwen3_moe`` (every layer MoE), seeded, fp32, in eval mode."""
    import transformers

    torch.manual_seed(0)
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON)).float().eval()
    config = transformers.Qwen3MoeConfig(**COMMON, **MOE, mlp_only_layers=[])
    return transformers.Qwen3MoeForCausalLM(config).float().eval()
