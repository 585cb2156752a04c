"""The parameters one rank holds, tensor by tensor, from megatron-core's own shapes.

Each :class:`Param` is one ``nn.Parameter`` of one model chunk on one rank (sizes already divided
by TP / expert TP, experts by EP), in megatron's order within a layer, so that the DDP buffer's
padding under the distributed optimizer (each parameter's start aligned to 64 elements) comes out
as megatron computes it. Checked against the weights megatron builds for every compare preset
(tests/plan).
"""

from __future__ import annotations

from dataclasses import dataclass

from mindspeed_like.plan.spec import Model, Run, stage_layers


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    expert: bool = False  # in the expert-parallel buffer (reduced over the expert data-parallel group)
    shared_embedding: bool = False  # the tied output weight's copy on the last stage (its own bucket)


def _norm(model: Model, name: str, width: int) -> list[Param]:
    rows = [Param(f"{name}.weight", width)]
    if model.normalization == "LayerNorm":
        rows.append(Param(f"{name}.bias", width))
    return rows


def attention(run: Run) -> list[Param]:
    m, tp = run.model, run.layout.tp
    h = m.hidden_size
    rows = _norm(m, "input_layernorm", h)
    if m.multi_latent_attention:
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        down = 1 if run.transformer_impl == "transformer_engine" else tp  # TE spec: duplicated
        if m.q_lora_rank:
            rows.append(Param("linear_q_down_proj.weight", h * m.q_lora_rank // down))
            rows += _norm(m, "q_layernorm", m.q_lora_rank)
            rows.append(Param("linear_q_up_proj.weight", m.q_lora_rank * m.num_attention_heads * qk // tp))
        else:
            rows.append(Param("linear_q_proj.weight", h * m.num_attention_heads * qk // tp))
        rows.append(Param("linear_kv_down_proj.weight", h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) // down))
        rows += _norm(m, "kv_layernorm", m.kv_lora_rank)
        rows.append(
            Param(
                "linear_kv_up_proj.weight",
                m.kv_lora_rank * m.num_attention_heads * (m.qk_head_dim + m.v_head_dim) // tp,
            )
        )
        rows.append(Param("linear_proj.weight", m.num_attention_heads * m.v_head_dim * h // tp))
        if m.add_bias_linear:
            rows.append(Param("linear_proj.bias", h))
        return rows
    width = (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels // tp
    rows.append(Param("linear_qkv.weight", h * width))
    if m.add_bias_linear or m.add_qkv_bias:
        rows.append(Param("linear_qkv.bias", width))
    if m.qk_layernorm:
        rows += _norm(m, "q_layernorm", m.kv_channels) + _norm(m, "k_layernorm", m.kv_channels)
    rows.append(Param("linear_proj.weight", m.num_attention_heads * m.kv_channels * h // tp))
    if m.add_bias_linear:
        rows.append(Param("linear_proj.bias", h))
    return rows


def mlp(model: Model, ffn: int, prefix: str, split: int, expert: bool = False) -> list[Param]:
    h = model.hidden_size
    fc1 = ffn * (2 if model.gated_linear_unit else 1) // split
    rows = [Param(f"{prefix}linear_fc1.weight", h * fc1, expert)]
    if model.add_bias_linear:
        rows.append(Param(f"{prefix}linear_fc1.bias", fc1, expert))
    rows.append(Param(f"{prefix}linear_fc2.weight", ffn // split * h, expert))
    if model.add_bias_linear:
        rows.append(Param(f"{prefix}linear_fc2.bias", h, expert))
    return rows


def layer(run: Run, index: int) -> list[Param]:
    """One decoder layer's parameters on this rank."""
    m, lay = run.model, run.layout
    rows = attention(run) + _norm(m, "pre_mlp_layernorm", m.hidden_size)
    if not m.layer_is_moe(index):
        return rows + mlp(m, m.ffn_hidden_size, "mlp.", lay.tp)
    rows.append(Param("mlp.router.weight", m.num_experts * m.hidden_size))
    for e in range(m.num_experts // lay.ep):
        rows += mlp(m, m.moe_ffn_hidden_size, f"mlp.experts.{e}.", lay.expert_tp, expert=True)
    if m.moe_shared_expert_intermediate_size:
        rows += mlp(m, m.moe_shared_expert_intermediate_size, "mlp.shared_experts.", lay.tp)
        if m.moe_shared_expert_gate:
            rows.append(Param("mlp.shared_experts.gate_weight", m.hidden_size))
    return rows


def embedding(run: Run) -> list[Param]:
    m = run.model
    rows = [Param("embedding.word_embeddings.weight", m.vocab_size // run.layout.tp * m.hidden_size)]
    if m.position_embedding_type == "learned_absolute":
        table = m.max_position_embeddings or m.seq_length
        rows.append(Param("embedding.position_embeddings.weight", table * m.hidden_size))
    return rows


def head(run: Run, has_embedding: bool) -> list[Param]:
    """Final norm, MTP layers and the output layer of the last chunk. A tied output weight is the
    embedding's own parameter where this chunk holds the embedding (PP = 1), else a copy megatron
    keeps in sync (``shared_embedding``)."""
    m = run.model
    rows = _norm(m, "decoder.final_layernorm", m.hidden_size)
    for i in range(m.mtp_num_layers):
        prefix = f"mtp.layers.{i}."
        rows += _norm(m, prefix + "enorm", m.hidden_size) + _norm(m, prefix + "hnorm", m.hidden_size)
        rows.append(Param(prefix + "eh_proj.weight", 2 * m.hidden_size * m.hidden_size // run.layout.tp))
        rows += [Param(prefix + p.name, p.numel, p.expert) for p in layer(run, m.num_layers - 1)]
        rows += _norm(m, prefix + "final_layernorm", m.hidden_size)
    out = m.vocab_size // run.layout.tp * m.hidden_size
    if not m.tied_embeddings:
        rows.append(Param("output_layer.weight", out))
    elif not has_embedding:
        rows.append(Param("output_layer.weight", out, shared_embedding=True))
    return rows


def chunk(run: Run, layers: tuple[int, ...], first: bool, last: bool) -> list[Param]:
    """The parameters of one model chunk on one rank: embedding (first chunk of the first stage),
    its decoder layers, the head (last chunk of the last stage)."""
    rows = embedding(run) if first else []
    for index in layers:
        rows += [
            Param(f"decoder.layers.{index}.{p.name}", p.numel, p.expert, p.shared_embedding) for p in layer(run, index)
        ]
    if last:
        rows += head(run, has_embedding=first)
    return rows


def stage(run: Run, stage_index: int) -> list[list[Param]]:
    """The parameters of every model chunk of one pipeline stage."""
    layout = stage_layers(run.model, run.layout)
    pp, chunks = run.layout.pp, run.layout.chunks
    return [
        chunk(run, layers, first=stage_index == 0 and c == 0, last=stage_index == pp - 1 and c == chunks - 1)
        for c, layers in enumerate(layout[stage_index])
    ]


def total(run: Run) -> int:
    """Parameters of the whole model (every rank's share once; experts over EP, TP shards summed)."""
    lay = run.layout
    count = 0
    for s in range(lay.pp):
        for params in stage(run, s):
            for p in params:
                if p.shared_embedding:
                    continue
                count += p.numel * (lay.expert_tp * lay.ep if p.expert else lay.tp if _split(p, run) else 1)
    return count


def _split(param: Param, run: Run) -> bool:
    """Whether a dense parameter is divided over TP (norms, biases of row-parallel layers and the
    router are replicated)."""
    name = param.name
    replicated = (
        "layernorm",
        "norm.",
        "enorm",
        "hnorm",
        "router",
        "linear_proj.bias",
        "linear_fc2.bias",
        "position_embeddings",
    )
    if any(r in name for r in replicated):
        return False
    if run.transformer_impl == "transformer_engine" and ("q_down_proj" in name or "kv_down_proj" in name):
        return False
    return True
