"""Model FLOPs of a training step, from the model's configuration (what `compare` divides by the
step time to print model FLOP utilisation).

What is counted, per token and per sequence, forward; a training step is 3x the forward (the
backward computes the gradients of the inputs and of the weights, each as large as the forward):

- every weight matrix a token passes through, 2 FLOPs per weight (a multiply and an add):
  attention's projections at their shapes (q: heads x head dim; k and v: query groups x head dim,
  so GQA counts its smaller k/v; multi-latent attention its down / up projections at the LoRA
  ranks, the rope part included), the MLP's (SwiGLU: fc1 is 2 x ffn wide, so 3 x hidden x ffn;
  GELU: 2 x hidden x ffn), on MoE layers the router (hidden x experts) and only the experts a token
  is routed to (top-k x the expert MLP) plus the shared experts, the output layer (hidden x
  vocabulary), and each multi-token-prediction layer (its 2h -> h projection, a layer like the
  decoder's last, the output layer again);
- causal self-attention's two matmuls (q k^T and probabilities x v): 2 x s^2 x heads x head dim
  each, halved because a causal mask leaves half the scores (2 x s^2 x h a layer for d = h / heads;
  the common ``6 x 2 x s^2 x h x layers / 2`` for a step);
- not counted: embeddings (a lookup), norms, softmax, activations, rotary embeddings, the loss,
  the optimizer step, and any recomputation (model FLOPs, not hardware FLOPs: a feature that
  recomputes does more work for the same model FLOPs).

So for a dense GPT with ``N`` matmul weights per token and ``T`` tokens a step: ``6 N T`` plus
``6 s^2 h L`` per sequence. The numbers are exact for the shapes built (the preset's
``model_args``), not estimates from a parameter count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelFlops:
    """Forward FLOPs: ``per_token`` (2 x the matmul weights a token passes through) and
    ``per_sequence`` (causal attention's score and value matmuls at ``seq_length``), with the
    breakdown of ``per_token`` by part."""

    per_token: float
    per_sequence: float
    seq_length: int
    parts: dict[str, float] = field(default_factory=dict)

    def per_step(self, sequences: int) -> float:
        """Model FLOPs of one training step over ``sequences`` sequences (forward + backward = 3x)."""
        return 3.0 * sequences * (self.per_token * self.seq_length + self.per_sequence)


def _mlp_weights(hidden: int, ffn: int, gated: bool) -> int:
    return (3 if gated else 2) * hidden * ffn


def _attention(args: dict[str, Any], hidden: int, heads: int, seq: int) -> tuple[int, float]:
    """Projection weights a token passes through, and forward FLOPs of the causal core a layer."""
    if args.get("multi_latent_attention"):
        qk, rope, v = args["qk_head_dim"], args["qk_pos_emb_head_dim"], args["v_head_dim"]
        q_rank, kv_rank = args.get("q_lora_rank"), args["kv_lora_rank"]
        q = hidden * q_rank + q_rank * heads * (qk + rope) if q_rank else hidden * heads * (qk + rope)
        kv = hidden * (kv_rank + rope) + kv_rank * heads * (qk + v)
        weights = q + kv + heads * v * hidden
        core = seq * seq * heads * ((qk + rope) + v)  # 2 s^2 n d per matmul, halved by the mask
        return weights, core
    head_dim = args.get("kv_channels") or hidden // heads
    groups = args.get("num_query_groups") or heads
    weights = hidden * head_dim * (heads + 2 * groups) + heads * head_dim * hidden
    core = 2 * seq * seq * heads * head_dim
    return weights, core


def _moe_layers(args: dict[str, Any]) -> list[bool]:
    layers = args["num_layers"]
    if not args.get("num_moe_experts"):
        return [False] * layers
    freq = args.get("moe_layer_freq", 1)
    if isinstance(freq, int):
        return [index % freq == 0 for index in range(layers)]
    return [bool(flag) for flag in freq]


def model_flops(args: dict[str, Any]) -> ModelFlops:
    """The forward FLOPs of the GPT that ``workloads.tiny_gpt(**args)`` builds (a preset's
    ``model_args``: its TransformerConfig and GPTModel fields)."""
    hidden, heads = args["hidden_size"], args["num_attention_heads"]
    seq, vocab = args["seq_length"], args["vocab_size"]
    gated = bool(args.get("gated_linear_unit", False))
    ffn = args.get("ffn_hidden_size") or 4 * hidden
    attention_weights, core = _attention(args, hidden, heads, seq)
    dense = _mlp_weights(hidden, ffn, gated)
    experts = args.get("num_moe_experts") or 0
    moe = 0
    if experts:
        moe_ffn = args.get("moe_ffn_hidden_size") or ffn
        shared = args.get("moe_shared_expert_intermediate_size") or 0
        moe = hidden * experts + args.get("moe_router_topk", 2) * _mlp_weights(hidden, moe_ffn, gated)
        moe += _mlp_weights(hidden, shared, gated) if shared else 0
    layer_kinds = _moe_layers(args)
    parts = {
        "attention projections": float(attention_weights * len(layer_kinds)),
        "dense MLPs": float(dense * layer_kinds.count(False)),
        "MoE router + routed top-k + shared experts": float(moe * layer_kinds.count(True)),
        "output layer": float(hidden * vocab),
    }
    mtp = args.get("mtp_num_layers") or 0
    if mtp:
        last = moe if layer_kinds and layer_kinds[-1] else dense
        parts["multi-token prediction"] = float(mtp * (2 * hidden * hidden + attention_weights + last + hidden * vocab))
    parts = {name: 2.0 * weights for name, weights in parts.items() if weights}
    attention_core = float(core * (len(layer_kinds) + mtp))
    return ModelFlops(per_token=sum(parts.values()), per_sequence=attention_core, seq_length=seq, parts=parts)


FORMULA = (
    "3 x forward; forward = 2 x (matmul weights a token passes: attention projections at their GQA/MLA shapes, "
    "MLPs, MoE router + top-k routed + shared experts, output layer, MTP) x tokens + causal attention "
    "2 x s^2 x heads x head dim per layer and sequence (q k^T and p v, halved by the mask); "
    "embeddings, norms, activations, softmax, loss, optimizer and recomputation not counted"
)
