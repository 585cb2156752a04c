"""Model presets for `mindspeed-like compare` and the demo: the shapes people train, in small.

Each preset turns the size arguments (layers, hidden, heads, seq) into megatron-core
TransformerConfig / GPTModel arguments for ``testing.tiny_gpt`` (megatron's local spec, so no
TransformerEngine is needed).
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
        if self.moe:  # Mixtral: 8 experts, top-2 routing, each expert a SwiGLU MLP
            llama.update(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=llama["ffn_hidden_size"])
        return llama


def _query_groups(heads: int) -> int:
    """Llama-style GQA: 4 query heads per key/value head where the heads divide, else 2, else MHA."""
    for per_group in (4, 2):
        if heads % per_group == 0 and heads // per_group >= 1:
            return heads // per_group
    return heads


PRESETS: dict[str, Preset] = {
    "llama": Preset("llama", "Llama: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases"),
    "moe": Preset("moe", "Mixtral-like MoE: the llama block with 8 SwiGLU experts, top-2 routing", moe=True),
    "gpt": Preset("gpt", "GPT-2: LayerNorm, GELU, learned positions, biases, tied embeddings"),
}
