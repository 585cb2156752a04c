"""Model presets for `mindspeed-like compare` and the demo: the shapes people train, in small.

Each preset turns the size arguments (layers, hidden, heads, seq) into megatron-core
TransformerConfig / GPTModel arguments for ``workloads.tiny_gpt`` (megatron's local or TE spec;
the TE spec runs on the te-backend where TransformerEngine is not installed).

MoE presets follow Megatron-LM's examples in asking for grouped GEMM (``moe_grouped_gemm=True``,
``--moe-grouped-gemm`` in ``examples/mixtral/train_mixtral_8x7b_distributed.sh`` and the
DeepSeek-V3 proxy): the TE spec then builds ``TEGroupedMLP`` in both arms. On the local spec
megatron's own ``GroupedMLP`` needs the CUDA ``grouped_gemm`` package, so there megatron's arm runs
what megatron can run without it, its expert loop (``SequentialMLP``), and the features arm the
grouped experts on the grouped-gemm feature's kernel, from the same weights (compare/worker.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _round_up(value: float, multiple: int) -> int:
    return int(-(-value // multiple) * multiple)


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    moe: bool = False
    num_experts: int = 0

    def model_args(self, *, num_layers: int, hidden_size: int, num_attention_heads: int, seq_length: int) -> dict:
        """``tiny_gpt`` keyword arguments for this preset at the given size (vocab 256: the
        demo's byte-level text)."""
        common: dict[str, Any] = dict(
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            seq_length=seq_length,
            vocab_size=256,
        )
        if self.name == "gpt":
            return dict(
                common,
                normalization="LayerNorm",
                gated_linear_unit=False,
                add_bias_linear=True,
                ffn_hidden_size=4 * hidden_size,
                position_embedding_type="learned_absolute",
                share_embeddings_and_output_weights=True,
            )
        # Llama: RMSNorm, SwiGLU with ffn ~ 8/3 hidden, RoPE, grouped-query attention, no biases.
        llama = dict(
            common,
            normalization="RMSNorm",
            gated_linear_unit=True,
            add_bias_linear=False,
            ffn_hidden_size=_round_up(8 * hidden_size / 3, 64),
            position_embedding_type="rope",
            num_query_groups=_query_groups(num_attention_heads),
        )
        if self.name == "llama3":
            # Llama-3-8B's block: ffn 3.5 x hidden (14336 at 4096, as Megatron-LM's
            # examples/llama/train_llama3_8b_h100_fp8.sh), 4 query heads per KV head (8 groups at 32
            # heads), rotary base 500000 (the model's rope_theta; that example sets 1e6); the
            # vocabulary stays the byte-level 256 of every preset
            llama.update(ffn_hidden_size=_round_up(3.5 * hidden_size, 64), rotary_base=500_000)
        elif self.name == "moe":  # Mixtral: 8 experts, top-2 routing, each expert a SwiGLU MLP
            llama.update(
                num_moe_experts=8,
                moe_router_topk=2,
                moe_ffn_hidden_size=llama["ffn_hidden_size"],
                moe_grouped_gemm=True,
            )
        elif self.name == "qwen3-moe":
            llama.update(_qwen3_moe(hidden_size))
        elif self.name == "deepseek":
            llama.update(_deepseek(num_layers, hidden_size, num_attention_heads))
        return llama


def _qwen3_moe(hidden_size: int) -> dict[str, Any]:
    """Qwen3-30B-A3B's flags (Megatron-LM ``examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh``)
    in small: the llama block (GQA, RoPE, RMSNorm, SwiGLU, untied) with qk-layernorm, rotary base
    1e6, every layer MoE: 8 experts (128 there) top-2 (8 there), softmax over the chosen experts'
    logits (megatron's default ``moe_router_pre_softmax=False``: HF's ``norm_topk_prob``), expert
    ffn 3/8 of hidden (768/2048), no shared experts, fp32 router, aux loss 1e-3, grouped GEMM.
    Head dim stays hidden/heads (128 there, twice 2048/32): the size arguments keep their meaning."""
    return dict(
        qk_layernorm=True,
        layernorm_epsilon=1e-6,
        rotary_base=1_000_000,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=_round_up(3 * hidden_size / 8, 16),
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-3,
        moe_grouped_gemm=True,
    )


def _deepseek(num_layers: int, hidden_size: int, num_attention_heads: int) -> dict[str, Any]:
    """DeepSeek-V3 in small, field for field the Megatron-LM flags of
    ``tests/integration/test_deepseek_megatron_lm.py`` (docs/megatron-lm.md, "Model classes tried"):

    - ``--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim
      --v-head-dim --qk-layernorm`` -> an ``MLATransformerConfig``: q LoRA rank ~hidden/5 (1536/7168),
      kv LoRA rank ~hidden/14 (512/7168), both rounded up to 16; qk/v head dim hidden/heads, the
      rope part half of it (64 of 128 there).
    - YaRN (MLA's default ``rope_type``; ``--rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim
      1.0 --rotary-base 10000``) -> ``rope_type="yarn"``, ``rotary_scaling_factor=40``, ``mscale``,
      ``mscale_all_dim``, ``rotary_base``.
    - ``--moe-router-score-function sigmoid --moe-router-enable-expert-bias
      --moe-router-bias-update-rate 1e-3 --moe-router-num-groups --moe-router-group-topk
      --moe-router-pre-softmax --moe-router-topk-scaling-factor 2.5 --moe-router-dtype fp32
      --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4`` -> the same
      ``moe_router_*`` fields: 8 experts (256 there) in 4 groups (8), the best 2 groups (4) kept,
      top-2 (8) experts; expert ffn ~hidden/4 (2048/7168) rounded up to 16.
    - ``--moe-shared-expert-intermediate-size`` -> one shared expert as wide as a routed one
      (``--moe-shared-expert-overlap`` is not set: the presets run at EP=1, where a host has no
      all-to-all for the shared experts to overlap with).
    - ``--moe-layer-freq ([0]+[1]*(L-1))`` -> ``moe_layer_freq``: the first layer dense (3 of 61
      there; ffn ~8/3 hidden like llama's), the rest MoE. With one layer it is MoE (the preset's point).
    - ``--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1`` -> one multi-token-prediction layer.
    - ``--moe-grouped-gemm --norm-epsilon 1e-6 --kv-channels`` -> ``moe_grouped_gemm``, ``layernorm_epsilon``,
      ``kv_channels`` (hidden/heads; MLA reads its own head dims).
    """
    head_dim = hidden_size // num_attention_heads
    moe_ffn = _round_up(hidden_size / 4, 16)
    return dict(
        num_query_groups=None,  # MLA: every head has its own latent-projected k and v
        multi_latent_attention=True,
        q_lora_rank=_round_up(hidden_size / 5, 16),
        kv_lora_rank=_round_up(hidden_size / 14, 16),
        qk_head_dim=head_dim,
        qk_pos_emb_head_dim=max(2, _round_up(head_dim / 2, 2)),
        v_head_dim=head_dim,
        kv_channels=head_dim,
        qk_layernorm=True,
        layernorm_epsilon=1e-6,
        rope_type="yarn",
        rotary_base=10000,
        rotary_scaling_factor=40.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        num_moe_experts=8,
        moe_layer_freq=[0] + [1] * (num_layers - 1) if num_layers > 1 else [1],
        moe_ffn_hidden_size=moe_ffn,
        moe_shared_expert_intermediate_size=moe_ffn,
        moe_router_dtype="fp32",
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        moe_router_topk=2,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_pre_softmax=True,
        moe_router_topk_scaling_factor=2.5,
        moe_aux_loss_coeff=1e-4,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_grouped_gemm=True,
        mtp_num_layers=1,
        mtp_loss_scaling_factor=0.1,
    )


def _query_groups(heads: int) -> int:
    """Llama-style GQA: 4 query heads per key/value head where the heads divide, else 2, else MHA."""
    for per_group in (4, 2):
        if heads % per_group == 0 and heads // per_group >= 1:
            return heads // per_group
    return heads


PRESETS: dict[str, Preset] = {
    "llama": Preset("llama", "Llama: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases"),
    "llama3": Preset(
        "llama3",
        "Llama-3-8B-shaped: the llama block with ffn 3.5x hidden (14336 at hidden 4096) and rotary base 500000",
    ),
    "moe": Preset(
        "moe", "Mixtral-like MoE: the llama block with 8 SwiGLU experts, top-2 routing", moe=True, num_experts=8
    ),
    "gpt": Preset("gpt", "GPT-2: LayerNorm, GELU, learned positions, biases, tied embeddings"),
    "qwen3-moe": Preset(
        "qwen3-moe",
        "Qwen3-MoE-like: the llama block with qk-layernorm, 8 SwiGLU experts top-2 (softmax over the top-k), "
        "no shared experts",
        moe=True,
        num_experts=8,
    ),
    "deepseek": Preset(
        "deepseek",
        "DeepSeek-V3-like: multi-latent attention with YaRN, first layer dense, 8 experts in 4 groups "
        "(sigmoid router, expert bias, group top-k), a shared expert, one MTP layer",
        moe=True,
        num_experts=8,
    ),
}
