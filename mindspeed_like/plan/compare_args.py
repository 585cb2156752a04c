"""`mindspeed-like compare`'s own options (``--preset llama --num-layers ... --optimization-level 2``)
read into a :class:`Run`: the model the compare workers build (``PRESETS[...].model_args``, vocab
256 unpadded as ``tiny_gpt`` builds it) in the layout they run (``_spec_layout``: PP microbatches
at PP > 1, fp32 grad buffers), so every compare record can be checked against its prediction.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from mindspeed_like.plan.spec import Layout, Model, Precision, Run, moe_pattern


def run_from_compare(args: argparse.Namespace, flags: dict[str, Any], device: str, command: Sequence[str] = ()) -> Run:
    """The run a ``mindspeed-like compare`` with these options trains (both arms share it)."""
    from mindspeed_like.compare.arguments import grad_reduce_in_fp32 as compare_grad_reduce_in_fp32
    from mindspeed_like.compare.arguments import virtual_stages
    from mindspeed_like.compare.presets import PRESETS

    preset = PRESETS[args.preset]
    m = preset.model_args(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
    )
    heads = m["num_attention_heads"]
    experts = m.get("num_moe_experts") or 0
    balance = m.get("moe_router_load_balancing_type", "aux_loss")
    model = Model(
        num_layers=m["num_layers"],
        hidden_size=m["hidden_size"],
        num_attention_heads=heads,
        ffn_hidden_size=m.get("ffn_hidden_size") or 4 * m["hidden_size"],
        vocab_size=m["vocab_size"],
        seq_length=m["seq_length"],
        kv_channels=m.get("kv_channels") or m["hidden_size"] // heads,
        num_query_groups=m.get("num_query_groups") or heads,
        normalization=m.get("normalization", "RMSNorm"),
        gated_linear_unit=m.get("gated_linear_unit", True),
        add_bias_linear=m.get("add_bias_linear", False),
        position_embedding_type=m.get("position_embedding_type", "rope"),
        tied_embeddings=bool(m.get("share_embeddings_and_output_weights", False)),
        qk_layernorm=bool(m.get("qk_layernorm", False)),
        num_experts=experts,
        moe_ffn_hidden_size=m.get("moe_ffn_hidden_size") or 0,
        moe_router_topk=m.get("moe_router_topk", 2),
        moe_layer_pattern=moe_pattern(m.get("moe_layer_freq", 1), m["num_layers"]) if experts else (),
        moe_shared_expert_intermediate_size=m.get("moe_shared_expert_intermediate_size") or 0,
        moe_router_dtype=m.get("moe_router_dtype"),
        moe_router_score_function=m.get("moe_router_score_function", "softmax"),
        moe_router_num_groups=m.get("moe_router_num_groups"),
        moe_router_enable_expert_bias=bool(m.get("moe_router_enable_expert_bias", False)),
        moe_aux_loss=balance in ("aux_loss", "seq_aux_loss") and m.get("moe_aux_loss_coeff", 0.0) > 0,
        moe_grouped_gemm=bool(m.get("moe_grouped_gemm", False)),
        moe_token_dispatcher_type=m.get("moe_token_dispatcher_type", "alltoall"),  # gpt_config's default
        multi_latent_attention=bool(m.get("multi_latent_attention", False)),
        q_lora_rank=m.get("q_lora_rank"),
        kv_lora_rank=m.get("kv_lora_rank") or 0,
        qk_head_dim=m.get("qk_head_dim") or 0,
        qk_pos_emb_head_dim=m.get("qk_pos_emb_head_dim") or 0,
        v_head_dim=m.get("v_head_dim") or 0,
        mtp_num_layers=m.get("mtp_num_layers") or 0,
    )
    pp = args.pipeline_model_parallel_size
    layout = Layout(
        tp=args.tensor_model_parallel_size,
        pp=pp,
        vpp=virtual_stages(args),
        cp=args.context_parallel_size,
        ep=args.expert_model_parallel_size,
        dp=args.data_parallel_size,
        sequence_parallel=args.sequence_parallel,
        micro_batch_size=args.micro_batch_size,
        num_microbatches=pp if pp > 1 else 1,
        # Megatron-FSDP's HSDP (records made before compare took these options ran without it)
        optimizer_instances=getattr(args, "num_distributed_optimizer_instances", 1),
        outer_sharding=getattr(args, "outer_dp_sharding_strategy", "no_shard"),
        **{"distributed_optimizer": args.use_distributed_optimizer, **fsdp_layout(args)},
    )
    precision = Precision(
        params="fp32" if args.fp32 else "bf16",
        grad_reduce_in_fp32=compare_grad_reduce_in_fp32(args),
        # the precision-aware optimizer (records made before compare took these options ran without it)
        precision_aware_optimizer=bool(getattr(args, "use_precision_aware_optimizer", False)),
        main_grads=getattr(args, "main_grads_dtype", "fp32"),
        main_params=getattr(args, "main_params_dtype", "fp32"),
        exp_avg=getattr(args, "exp_avg_dtype", "fp32"),
        exp_avg_sq=getattr(args, "exp_avg_sq_dtype", "fp32"),
        # Megatron-FSDP's buffer dtypes (records made before compare took these options ran at the defaults)
        fsdp_main_params=getattr(args, "megatron_fsdp_main_params_dtype", "fp32"),
        fsdp_main_grads=getattr(args, "megatron_fsdp_main_grads_dtype", "auto"),
    )
    return Run(
        model=model,
        layout=layout,
        precision=precision,
        transformer_impl=args.transformer_impl,
        device=device,
        flags=dict(flags),
        command=tuple(command),
        source="compare",
        steps=args.steps,
    )


def fsdp_layout(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`Layout` fields of compare's sharded data-parallel path (``data_parallel_path``'s
    names; records made before compare took these options ran under DDP)."""
    if getattr(args, "use_torch_fsdp2", False):
        return {"fsdp": "torch_fsdp2", "reshard_after_forward": not args.torch_fsdp2_no_reshard_after_forward}
    if getattr(args, "use_megatron_fsdp", False):
        # Megatron-FSDP's optimizer is megatron's distributed one (train_steps sets it, Megatron-LM asserts it)
        return {
            "fsdp": "megatron_fsdp",
            "sharding_strategy": args.data_parallel_sharding_strategy,
            "distributed_optimizer": True,
        }
    return {}
