"""What `plan` predicts for: one training run, normalized from whichever parser read it.

Every parser (Megatron-LM's own, the built-in one with Megatron-LM's names and defaults, or
`mindspeed-like compare`'s options) ends in a :class:`Run`; the memory and time models read only
this, never a parser's namespace. Sizes are the model's (global); what one rank holds is derived
from them and the :class:`Layout` by the models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from mindspeed_like.toolkit.errors import ConfigError

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class Model:
    """A GPT's shapes (megatron-core's TransformerConfig / GPTModel fields)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int  # padded (megatron's padded_vocab_size)
    seq_length: int
    kv_channels: int
    num_query_groups: int
    # rows of the learned position-embedding table (GPTModel's max_sequence_length: Megatron-LM passes
    # --max-position-embeddings); None: seq_length, as compare's models are built
    max_position_embeddings: int | None = None
    normalization: str = "RMSNorm"  # or LayerNorm
    gated_linear_unit: bool = True  # SwiGLU
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    position_embedding_type: str = "rope"
    tied_embeddings: bool = False
    qk_layernorm: bool = False
    # megatron's dropout probabilities (Megatron-LM's defaults are 0.1; compare's presets run none)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # megatron's unfused attention softmax upcasts fp16/bf16 scores to fp32 (TransformerConfig's
    # default, compare's models); Megatron-LM's --attention-softmax-in-fp32 is off by default
    attention_softmax_in_fp32: bool = True
    # MoE
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 2
    moe_layer_pattern: tuple[int, ...] = ()  # 1 = MoE layer, 0 = dense (megatron's moe_layer_freq)
    moe_shared_expert_intermediate_size: int = 0
    moe_shared_expert_gate: bool = False  # a sigmoid gate (one [1, h] weight) on the shared experts' output
    moe_router_dtype: str | None = None  # fp32 / fp64 / None (the model's dtype)
    moe_router_score_function: str = "softmax"
    moe_router_num_groups: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_aux_loss: bool = False  # a load-balancing loss that saves the router's full scores
    moe_grouped_gemm: bool = False
    # megatron-core's default; compare's MoE runs take alltoall (workloads/models.py gpt_config)
    moe_token_dispatcher_type: str = "allgather"
    # MLA
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    # multi-token prediction
    mtp_num_layers: int = 0
    # Megatron-LM's defaults that compare's models (megatron's TransformerConfig defaults) run without:
    # --bias-swiglu-fusion (bias_activation_fusion: megatron's fused SwiGLU keeps only its input) and
    # --create-attention-mask-in-dataloader (one b x s x s bool mask every layer's softmax shares)
    bias_swiglu_fusion: bool = False
    attention_mask_in_dataloader: bool = False
    # the tokenizer's vocabulary before megatron pads it (a multiple of vocab_divisible_by x TP), so
    # another TP (``--fit``) pads it again; None where the padded size was given (compare's presets)
    vocab_unpadded: int | None = None
    vocab_divisible_by: int = 128

    def vocab_for_tp(self, tp: int) -> int:
        """The embedding's rows at tensor-parallel size ``tp``: megatron pads the vocabulary per TP."""
        if self.vocab_unpadded is None:
            return self.vocab_size
        return pad_vocab(self.vocab_unpadded, self.vocab_divisible_by, tp)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, index: int) -> bool:
        return self.is_moe and bool(self.moe_layer_pattern[index])


@dataclass(frozen=True)
class Layout:
    """The parallel layout: megatron's decomposition of the world, and the batch."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None  # model chunks per pipeline rank (interleaved schedule)
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel (megatron: TP by default)
    dp: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    num_microbatches: int = 1  # per step, per data-parallel rank
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False  # megatron's DDP then buckets the gradients (40M elements or more)
    first_stage_layers: int | None = None  # megatron's decoder_first/last_pipeline_num_layers
    last_stage_layers: int | None = None
    # --account-for-embedding/loss-in-pipeline-split: each counts as a layer of the split (the first
    # slice builds one decoder layer less, the last one less)
    embedding_in_split: bool = False
    loss_in_split: bool = False
    layer_layout: str | None = None  # --pipeline-model-parallel-layout (plan/layer_layout.py)
    microbatch_group: int | None = None  # --microbatch-group-size-per-virtual-pipeline-stage (PP by default)
    # megatron's sharded data-parallel wrappers (Megatron-LM's --use-torch-fsdp2 / --use-megatron-fsdp), by
    # compare's names (``data_parallel_path``): None (DDP), "torch_fsdp2" or "megatron_fsdp"
    fsdp: str | None = None
    reshard_after_forward: bool = True  # torch FSDP2 (--torch-fsdp2-no-reshard-after-forward: False)
    sharding_strategy: str = "no_shard"  # Megatron-FSDP's --data-parallel-sharding-strategy
    # --num-distributed-optimizer-instances: under Megatron-FSDP its hybrid sharding (HSDP: sharded within each of
    # N groups of DP x CP / N ranks, replicated across them); --outer-dp-sharding-strategy: "optim" also shards the
    # masters and moments across the groups (plan/fsdp.py hybrid_groups)
    optimizer_instances: int = 1
    outer_sharding: str = "no_shard"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def chunks(self) -> int:
        return self.vpp or 1


@dataclass(frozen=True)
class Precision:
    """Parameter, gradient and optimizer-state dtypes (Megatron-LM's flags after validate_args)."""

    params: str = "bf16"  # bf16 / fp16 / fp32
    grad_reduce_in_fp32: bool = True  # --accumulate-allreduce-grads-in-fp32 (Megatron-LM sets it for bf16)
    precision_aware_optimizer: bool = False
    main_grads: str = "fp32"
    main_params: str = "fp32"
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"
    optimizer: str = "adam"  # adam / sgd / muon / dist_muon (--optimizer)
    sgd_momentum: float = 0.9  # --sgd-momentum: 0 keeps no momentum buffer
    # Megatron-FSDP's buffer dtypes (Megatron-LM 0.17+'s --megatron-fsdp-main-params-dtype and
    # --megatron-fsdp-main-grads-dtype: fp32 / bf16 / fp16 / auto, auto being megatron's None)
    fsdp_main_params: str = "fp32"
    fsdp_main_grads: str = "auto"

    @property
    def param_bytes(self) -> int:
        return BYTES[self.params]

    @property
    def grad_dtype(self) -> str:
        """DDP's grad buffer dtype: fp32 when accumulated in fp32, else the parameters' (or the
        precision-aware optimizer's bf16 main grads)."""
        if self.params == "fp32":
            return "fp32"
        if self.precision_aware_optimizer and self.main_grads == "bf16":
            return "bf16"
        return "fp32" if self.grad_reduce_in_fp32 else self.params

    @property
    def grad_bytes(self) -> int:
        return BYTES[self.grad_dtype]


@dataclass(frozen=True)
class Recompute:
    """megatron's activation recomputation (--recompute-granularity / -method / -num-layers / -modules)."""

    granularity: str | None = None  # None, "full", "selective"
    method: str | None = None  # "uniform" / "block" (full)
    num_layers: int | None = None
    modules: tuple[str, ...] = ("core_attn",)  # selective


@dataclass(frozen=True)
class Run:
    """One run: the model, its layout, precision, recomputation, the implementation megatron builds
    (``transformer_impl``: our te-backend or the local spec when TransformerEngine is absent), and
    the feature flags of the features arm (this library's config values, resolved)."""

    model: Model
    layout: Layout
    precision: Precision = field(default_factory=Precision)
    recompute: Recompute = field(default_factory=Recompute)
    transformer_impl: str = "transformer_engine"
    device: str = "cuda"
    flags: dict[str, Any] = field(default_factory=dict)
    command: tuple[str, ...] = ()  # the Megatron-LM arguments as given (for --fit's command line)
    source: str = "builtin"  # which parser read it: megatron-lm, builtin, compare
    steps: int | None = None  # training steps (compare's --steps, --train-iters); None: a long run
    not_modeled: tuple[str, ...] = ()  # options given that the models do not read (said once)
    notes: tuple[str, ...] = ()  # what the parser could not do as asked, said in the output
    # the routed rows an expert-parallel rank's experts receive, as a multiple of the balanced share (1:
    # the mean rank; predict.routed_rows_bound gives the largest rank's bound under dropless routing)
    moe_rows_factor: float = 1.0

    def with_layout(self, **changes: Any) -> Run:
        return replace(self, layout=replace(self.layout, **changes))


def pad_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """megatron's ``_vocab_size_with_padding``: up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def moe_pattern(freq: int | list[int] | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """megatron's ``moe_layer_freq``: an int N (every N-th layer is MoE, from layer 0) or a list."""
    if isinstance(freq, int):
        return tuple(1 if i % freq == 0 else 0 for i in range(num_layers))
    pattern = tuple(int(x) for x in freq)
    if len(pattern) != num_layers:
        raise ConfigError(f"plan: --moe-layer-freq has {len(pattern)} entries for {num_layers} layers")
    return pattern


def stage_layers(model: Model, layout: Layout) -> list[list[tuple[int, ...]]]:
    """The decoder layer indices of every pipeline rank's model chunks: ``[stage][chunk] -> layers``
    (megatron's even split, with --decoder-first/last-pipeline-num-layers honoured at VPP 1; the
    interleaved schedule gives chunk c of stage p the (c x PP + p)-th slice)."""
    pp, chunks, n = layout.pp, layout.chunks, model.num_layers
    if layout.layer_layout is not None:
        from mindspeed_like.plan import layer_layout

        return layer_layout.decoder_layers(layout.layer_layout, pp, n)
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if chunks == 1 and (first is not None or last is not None):
        counts = [0] * pp
        rest = n - (first or 0) - (last or 0)
        middle = pp - (first is not None) - (last is not None)
        if middle < 0 or (middle and rest % middle) or (not middle and rest):
            raise ConfigError("plan: the uneven pipeline split leaves layers that do not divide over the other stages")
        per = rest // middle if middle else 0
        for s in range(pp):
            counts[s] = per
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        out, start = [], 0
        for c in counts:
            out.append([tuple(range(start, start + c))])
            start += c
        return out
    slices = pp * chunks
    emb, loss = int(layout.embedding_in_split), int(layout.loss_in_split)
    split = n + emb + loss
    if split % slices:
        named = " and ".join(what for what, on in (("the embedding", emb), ("the loss", loss)) if on)
        counted = f" (with {named} counted as {'layers' if emb and loss else 'a layer'})" if named else ""
        raise ConfigError(
            f"plan: --num-layers {n}{counted} does not divide into {pp} pipeline stages x {chunks} virtual stages "
            "(megatron refuses it)"
        )
    per = split // slices

    def decoder(k: int) -> tuple[int, ...]:  # slice k's positions of the split, less the embedding's and the loss's
        return tuple(g - emb for g in range(k * per, (k + 1) * per) if 0 <= g - emb < n)

    return [[decoder(c * pp + s) for c in range(chunks)] for s in range(pp)]
