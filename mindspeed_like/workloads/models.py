"""Tiny megatron-core GPT models (local spec: no TransformerEngine needed): what the demo, compare and
plan's checks build, and tests too."""

from __future__ import annotations

import inspect
from typing import Any

# TransformerConfig defaults for tests. add_bias_linear=False on purpose: selective `mlp`
# recompute with biases recurses without end in megatron-core 0.13-0.16, and MoE experts with
# biases fail at TP=1 (notes/megatron-core-on-cpu.md).
DEFAULTS: dict[str, Any] = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=None,
    normalization="RMSNorm",
    gated_linear_unit=True,
    activation_func=None,  # swiglu when gated_linear_unit (see gpt_config)
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_cpu_initialization=True,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,
    init_method_std=0.02,
)

# GPTModel arguments that are not TransformerConfig fields.
MODEL_DEFAULTS: dict[str, Any] = dict(
    vocab_size=256,
    max_sequence_length=32,
    position_embedding_type="rope",
    rotary_percent=1.0,
    share_embeddings_and_output_weights=False,
    # pipeline stages (``vp_stage``: the virtual stage of an interleaved pipeline), as Megatron-LM's
    # get_model builds each model chunk
    pre_process=True,
    post_process=True,
    vp_stage=None,
)


def gpt_config(**overrides: Any):
    """A TransformerConfig for a tiny GPT; tensor/sequence/expert parallel sizes come from
    ``parallel_state`` unless given. MoE: pass ``num_moe_experts`` (and ``moe_router_topk``,
    ``moe_token_dispatcher_type``, ``moe_grouped_gemm``, ``moe_ffn_hidden_size``)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(DEFAULTS)
    values.update(overrides)
    if values.get("activation_func") is None:
        values["activation_func"] = F.silu if values.get("gated_linear_unit") else F.gelu
    if values.get("ffn_hidden_size") is None:
        values["ffn_hidden_size"] = 2 * values["hidden_size"]
    if parallel_state.model_parallel_is_initialized():
        values.setdefault("tensor_model_parallel_size", parallel_state.get_tensor_model_parallel_world_size())
        values.setdefault("expert_model_parallel_size", parallel_state.get_expert_model_parallel_world_size())
        values.setdefault("pipeline_model_parallel_size", parallel_state.get_pipeline_model_parallel_world_size())
    if values.get("num_moe_experts"):
        values.setdefault("moe_router_topk", 2)
        values.setdefault("moe_token_dispatcher_type", "alltoall")
        values.setdefault("moe_ffn_hidden_size", values["ffn_hidden_size"])
        values.setdefault("moe_aux_loss_coeff", 0.0)
    if values.get("bf16"):
        values.setdefault("params_dtype", __import__("torch").bfloat16)
        values.setdefault("pipeline_dtype", __import__("torch").bfloat16)
    if values.get("multi_latent_attention"):
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        for name, value in MLA_DEFAULTS.items():
            values.setdefault(name, value)
        return MLATransformerConfig(**values)
    return TransformerConfig(**values)


# Multi-latent attention sizes for a tiny GPT (``multi_latent_attention=True``): LoRA ranks on both
# projections, a rope part of the q/k head dim, and a V head dim different from q/k's.
MLA_DEFAULTS: dict[str, Any] = dict(
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=12,
    rope_type="rope",
)


def tiny_gpt(*, wrap_float16: bool = True, transformer_impl: str = "local", **overrides: Any):
    """A megatron-core GPTModel from ``get_gpt_layer_local_spec()`` with tiny sizes
    (``transformer_impl="transformer_engine"``: from ``get_gpt_layer_with_transformer_engine_spec()``,
    which needs TransformerEngine or the te-backend).

    Overrides go to :func:`gpt_config` (TransformerConfig fields) or to GPTModel
    (``vocab_size``, ``max_sequence_length`` alias ``seq_length``, ``position_embedding_type``,
    ``rotary_percent``, ``share_embeddings_and_output_weights``, ``pre_process`` / ``post_process`` /
    ``vp_stage`` for a pipeline stage's chunk, and ``rotary_base`` except with multi-latent attention,
    whose config holds it). Defaults: 2 layers, hidden 64, 4 heads, seq 32,
    vocab 256, RMSNorm, SwiGLU, RoPE, no biases, no dropout, CPU initialization.

    MoE with dense layers mixed in (``moe_layer_freq`` other than 1) builds megatron's decoder block
    spec (``get_gpt_decoder_block_spec``); ``mtp_num_layers`` adds megatron's MTP block
    (``get_gpt_mtp_block_spec``) on the decoder's spec; ``multi_latent_attention=True`` an
    ``MLATransformerConfig`` (``MLA_DEFAULTS`` for the sizes not given).

    The same seed gives the same model function at every tensor-parallel size, in every
    supported megatron-core version (see :func:`_gated_fc1_layout_of_tp1`).

    ``bf16=True`` builds a bf16 config; with ``wrap_float16`` (default) the model is returned
    wrapped in megatron's ``Float16Module`` (what megatron's training loop does), otherwise the
    caller wraps it. ``model.config`` is the TransformerConfig in both cases.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model_args = dict(MODEL_DEFAULTS)
    if "seq_length" in overrides:
        overrides["max_sequence_length"] = overrides.pop("seq_length")
    for key in list(overrides):
        if key in MODEL_DEFAULTS:
            model_args[key] = overrides.pop(key)
    if "rotary_base" in overrides and not overrides.get("multi_latent_attention"):
        model_args["rotary_base"] = overrides.pop("rotary_base")  # GPTModel's; MLA's config has its own
    config = gpt_config(**overrides)
    spec_args = dict(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
    )
    if transformer_impl not in ("local", "transformer_engine"):
        raise ValueError(f"transformer_impl {transformer_impl!r}: choose 'local' or 'transformer_engine'")
    use_te = transformer_impl == "transformer_engine"
    if config.num_moe_experts and config.moe_layer_freq != 1:
        # dense and MoE layers mixed (``moe_layer_freq``): megatron's block spec, as Megatron-LM's
        # pretrain_gpt.py builds every MoE model
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=config.normalization)
    elif use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(**spec_args)
    else:
        if "normalization" in inspect.signature(get_gpt_layer_local_spec).parameters:  # not in every version
            spec_args["normalization"] = config.normalization
        spec = get_gpt_layer_local_spec(**spec_args)
    if getattr(config, "mtp_num_layers", None):
        # multi-token prediction: megatron's MTP block on the decoder's (last) layer spec, as pretrain_gpt.py
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        model_args["mtp_block_spec"] = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te)
    if hasattr(config, "transformer_impl"):
        # what Megatron-LM's config carries for --transformer-impl: megatron's FSDP2 wrapper reads it to
        # choose its sharding units (its default, "transformer_engine", names TE classes a local spec lacks)
        config.transformer_impl = transformer_impl
    model = GPTModel(config=config, transformer_layer_spec=spec, **model_args)
    _gated_fc1_layout_of_tp1(model, config)
    if config.bf16 and wrap_float16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def _gated_fc1_layout_of_tp1(model, config) -> None:
    """Give each TP rank the [gate shard; up shard] rows of the gated fc1 master weight.

    A gated MLP's ``linear_fc1`` computes [gate; up] and each TP rank applies the GLU to its
    own output chunk, so rank r must hold rows (gate_r; up_r) of the master weight. megatron-core
    0.16 builds fc1 with ``stride=2`` so ``use_cpu_initialization`` scatters exactly that;
    0.13-0.15 use stride 1 and scatter contiguous rows (rank 0 all of gate, rank 1 all of up at
    TP=2): a valid but *different* network from the TP=1 one of the same seed, so "TP=2 equals
    TP=1" cannot hold there for a reason that is megatron's init, not the parallel math.
    For those versions (recognised by the weight's ``partition_stride`` of 1, not by version
    number) the master weight is gathered from the ranks and re-scattered with stride 2, i.e.
    what 0.16 does. Dense MLPs only (expert MLPs keep their layout); needs the CPU init, where
    one master weight exists.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.mlp import MLP

    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    if tp == 1 or not config.gated_linear_unit or not config.use_cpu_initialization:
        return
    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    for module in model.modules():
        if not isinstance(module, MLP) or getattr(module, "is_expert", False):
            continue
        fc1 = module.linear_fc1
        tensors = [fc1.weight] + ([fc1.bias] if getattr(fc1, "bias", None) is not None else [])
        for tensor in tensors:
            if getattr(tensor, "partition_stride", 1) != 1 or getattr(tensor, "partition_dim", 0) != 0:
                continue
            with torch.no_grad():
                shards = [torch.empty_like(tensor) for _ in range(tp)]
                dist.all_gather(shards, tensor.detach().contiguous(), group=group)
                chunks = torch.cat(shards, dim=0).chunk(2 * tp, dim=0)  # the master weight
                tensor.copy_(torch.cat([chunks[rank], chunks[rank + tp]], dim=0))
            tensor.partition_stride = 2
