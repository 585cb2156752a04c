"""Model state and the gathered parameters under megatron's two FSDP paths, per rank.

- **torch FSDP2** (``--use-torch-fsdp2``: megatron's ``TorchFullyShardedDataParallel``): every
  parameter is a DTensor sharded over the data-parallel ranks (DP x CP); each rank keeps its
  1/DP slice in the model dtype, its sharded gradient in the model dtype (megatron sets no
  ``MixedPrecisionPolicy``: FSDP2 reduce-scatters in the parameters' dtype) from backward until the
  optimizer step, and megatron's ``Float16OptimizerWithFloat16Params`` keeps an fp32 master of its
  shard and Adam's two fp32 moments of it (4 + 8 bytes a sharded element). The FSDP units are
  megatron's choice (``sub_modules_to_wrap``): every TransformerLayer, the embedding, the output
  layer (a ColumnParallelLinear, except on the local spec, where the transformer layers' own linears
  are ColumnParallelLinears and megatron leaves the class out), and the root for the rest (the final
  norm). A unit's parameters are all-gathered (unsharded, model dtype) for its forward and again for
  its backward; with reshard_after_forward (the default) they are freed after each, so one unit is
  in flight in forward, and in backward this unit's and the prefetched next one's (FSDP2's default
  backward prefetch) beside this unit's unsharded gradients before their reduce-scatter. Without it
  (``--torch-fsdp2-no-reshard-after-forward``, ZeRO-2) every unit's gathered parameters stay from
  its forward to its backward; the ones autograd saves count where compare's activation probe
  counts them. The root unit is never resharded after forward (FSDP2's rule for the root).
- **Megatron-FSDP** (``--use-megatron-fsdp``): per parameter group, a model-weight buffer (model dtype), a
  main-weight buffer (the fp32 masters) and a main-grad buffer (fp32 under
  ``--accumulate-allreduce-grads-in-fp32`` on megatron-core 0.16-0.18, else the model dtype; 0.19 keeps it in
  the model dtype whatever that flag says, and every release hands the optimizer a gradient shard cast to the
  masters' fp32, a copy kept beside a buffer that is not fp32: :func:`megatron_fsdp_grad_dtype`, counted as
  gradients, as compare's meter counts it); ``--data-parallel-sharding-strategy`` says which are sharded over
  DP: ``optim`` the masters (and so Adam's fp32 moments), ``optim_grads`` also the gradients,
  ``optim_grads_params`` also the model-dtype weights (then the TransformerLayers are FSDP units whose buckets
  are all-gathered for their forward and backward). ``no_shard`` keeps everything whole (refused on
  megatron-core 0.14-0.18: fixes/megatron_fsdp_no_shard.py). compare's meter counts each buffer by its kind:
  weights = the model-weight buffer, optimizer = the fp32 main-weight buffer (the masters, which the module's
  parameters view during a step) and Adam's two fp32 moments and step counters (optim_grads_params at bf16:
  2/DP + 4/DP + 12/DP bytes a parameter). Measured at DP 2 and 4 (compare's records): every kind within 0.7%.
  Each group's buffer is padded to a multiple of DP x its rows' width (``build_data_parallel_buffer_index``),
  which the plan leaves out (0.1-0.7% on compare's tiny models, less on larger ones). The TransformerLayers'
  gathered buckets are alive again when the forward ends on megatron-core 0.16 and 0.17 (the output layer's
  all-gather prefetches them), so compare's activation probe counts them and the plan counts them there too;
  0.18 and 0.19 stop that prefetch from the second step on (:func:`saved_gathered_bytes`).

fsdp2-config (this library's, the features arm): ``sharding_size`` (HSDP) shards over the shard group
instead (``paths.fsdp2_fields``, state.py), a bool ``reshard_after_forward`` acts as the flag does, and
``num_to_forward_prefetch`` / ``num_to_backward_prefetch`` set the units in flight. Megatron-FSDP's
HSDP (``--num-distributed-optimizer-instances N``, ``--outer-dp-sharding-strategy``): every buffer sharded
over an instance's DP x CP / N ranks, and under outer ``optim`` the masters and moments over all DP x CP
ranks (:func:`hybrid_groups`; compare's records at DP 4, 2 instances, with and without outer sharding).
Megatron-FSDP's buffer dtypes (megatron-core 0.17+'s ``megatron_fsdp_main_params_dtype`` /
``megatron_fsdp_main_grads_dtype``, Megatron-LM's ``--megatron-fsdp-main-params-dtype`` / ``-main-grads-dtype``):
the main-weight buffer in its dtype or none (``auto``: the optimizer steps the weights' shard), the main-grad buffer
in its own (``auto``: the parameters'), the copy for the masters where the two differ, and torch's Adam moments in
the dtype of what it steps (:func:`megatron_fsdp_main_params_dtype`; refused where megatron stops at the first step:
:func:`megatron_fsdp_dtype_refusal`). The precision-aware optimizer (``--use-precision-aware-optimizer``) takes the
main-grad buffer's shard as ``.decoupled_grad`` on 0.18+ (no copy; its moments in the dtypes asked for) and is
refused before (:func:`megatron_fsdp_precision_aware_refusal`: no weight would be updated).
Not modeled: fsdp2-config's other keys (dtypes, units, an int reshard_after_forward, offload: said in the
output), FP8 parameter gathering, CPU offloading, ``--megatron-fsdp-grad-comm-dtype`` (HSDP's gradient
communication buffers), TE's FusedAdam keeping fp32 moments where Megatron-FSDP keeps no fp32 masters (torch's Adam
is counted: its moments in the stepped parameters' dtype), and this library's other state features
(reuse-fp32-param, the precision-aware optimizer under torch FSDP2) on these paths: counted as megatron's. Level 2's
megatron-fsdp-lean-state under Megatron-FSDP is modeled (state.py: no main-weight buffer, bf16 gradients,
int16 remainders and bf16 moments).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mindspeed_like.plan.params import Param
from mindspeed_like.plan.paths import Paths
from mindspeed_like.plan.spec import BYTES, Precision, Run

TORCH_FSDP2 = "torch_fsdp2"
MEGATRON_FSDP = "megatron_fsdp"
PATHS = (TORCH_FSDP2, MEGATRON_FSDP)
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: the parameters gathered together."""

    name: str
    params: tuple[Param, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


def group_size(run: Run, expert: bool = False) -> int:
    """The ranks a parameter is sharded over: megatron's data-parallel group with context parallelism,
    or for an expert's parameter its expert data-parallel group (TP x CP x DP / (expert TP x EP))."""
    lay = run.layout
    if expert:
        return max(1, lay.tp * lay.cp * lay.dp // (lay.expert_tp * lay.ep))
    return lay.dp * lay.cp


def hybrid_groups(run: Run, expert: bool = False) -> tuple[int, int]:
    """Megatron-FSDP's shard groups of one parameter: (the ranks its model-weight and main-grad buffers
    are sharded over, the ranks its fp32 masters and Adam's moments are sharded over).

    Without HSDP both are :func:`group_size`. With ``--num-distributed-optimizer-instances N``
    (megatron-core 0.16.1, ``mcore_fsdp_adapter._init_dist_index``) the shard group is the
    intra-instance data-parallel group (``partial_data_parallel=True``: DP x CP / N ranks) and the N
    groups are replicas; ``--outer-dp-sharding-strategy optim`` builds the main buffers over the whole
    DP x CP group (``get_dp_group``: the hybrid group) and keeps the weights and gradients in the
    intra-instance ``hsdp_wbuf`` / ``hsdp_gbuf`` (param_and_grad_buffer.py, "the weight and gradient
    memory footprint is similar to not sharding on DP-Outer"), so only the masters and the moments
    shrink by N. An expert's parameters under HSDP, where megatron-core builds an expert mesh for it
    (0.17.1-0.19.2: ``_init_dist_index``'s ``expt_device_mesh`` over the intra-instance expert data-parallel
    group, ``hybrid_fsdp_expt_group`` the whole expert data-parallel group): the same split of their
    expert data-parallel group (:func:`group_size`), its N instances replicas. Where it builds none
    (0.16.1: the expert group is None and a collective runs over the world), HSDP at EP > 1 is refused
    (``fixes/megatron_fsdp_hsdp_experts.py``; :func:`hybrid_sharding_refusal`), and at EP 1 that group is
    the world: the experts shard over every rank."""
    lay = run.layout
    whole = group_size(run, expert)
    if lay.fsdp != MEGATRON_FSDP or lay.optimizer_instances <= 1:
        return whole, whole
    if expert and not _expert_mesh_under_hsdp():
        world = lay.world_size
        return world, world
    inner = whole // lay.optimizer_instances
    return inner, (whole if lay.outer_sharding == "optim" else inner)


def _expert_mesh_under_hsdp() -> bool:
    """Whether megatron-core builds Megatron-FSDP's expert mesh under hybrid sharding: the installed release's
    source says (fixes/megatron_fsdp_hsdp_experts.py; one without Megatron-FSDP's adapter is planned as the
    newest layout); predicting a record of another release (``megatron_code.as_measured_on``), 0.17 and
    later build it (read in 0.17.1, 0.18.2 and 0.19.2), 0.16 not (read in 0.16.1)."""
    from mindspeed_like.fixes.megatron_fsdp_hsdp_experts import expert_mesh_under_hsdp
    from mindspeed_like.plan import megatron_code

    if megatron_code._recent:
        return megatron_code.release().release >= (0, 17)
    return expert_mesh_under_hsdp() is not False


def megatron_fsdp_grad_dtype(precision: Precision) -> str:
    """The dtype of Megatron-FSDP's main-grad buffer. Where the release sizes it by ``grad_reduce_in_fp32``
    (0.16-0.18, :func:`megatron_code.megatron_fsdp_grads_follow_grad_reduce_in_fp32`) and that is set
    (``--accumulate-allreduce-grads-in-fp32``, Megatron-LM's bf16 default and compare's): fp32; 0.16 has no other
    knob (DDP's grad dtype). Otherwise ``--megatron-fsdp-main-grads-dtype`` where the release has it
    (:func:`megatron_code.megatron_fsdp_has_main_dtype_fields`: 0.17+), its ``auto`` (megatron's None, the default)
    being the parameters' dtype (``_resolve_group_grad_dtype``, 0.19.2)."""
    from mindspeed_like.plan import megatron_code

    if megatron_code.megatron_fsdp_grads_follow_grad_reduce_in_fp32():
        if not megatron_code.megatron_fsdp_has_main_dtype_fields():
            return precision.grad_dtype
        if precision.grad_reduce_in_fp32:
            return "fp32"  # 0.17/0.18's "Grandfathered Argument", whatever megatron_fsdp_main_grads_dtype says
    return precision.params if precision.fsdp_main_grads == "auto" else precision.fsdp_main_grads


def megatron_fsdp_main_params_dtype(precision: Precision) -> str | None:
    """The dtype of Megatron-FSDP's main-weight buffer (the parameters its optimizer steps), or None where it
    makes none: ``--megatron-fsdp-main-params-dtype`` (``auto``: None, the optimizer steps the model-weight
    buffer's shard in the parameters' dtype; ``_init_distributed_params`` falls back from the main-weight buffer to
    the model-weight buffer, 0.19.2), fp32 by default where the release keeps fp32 masters
    (:func:`megatron_code.megatron_fsdp_keeps_fp32_masters`: every release 0.16-0.19)."""
    from mindspeed_like.plan import megatron_code

    if precision.fsdp_main_params == "auto":
        return None
    if precision.fsdp_main_params == "fp32":
        return "fp32" if megatron_code.megatron_fsdp_keeps_fp32_masters() else None
    return precision.fsdp_main_params


def megatron_fsdp_grad_copy_dtype(precision: Precision) -> str | None:
    """The dtype of the copy of each rank's gradient shard that Megatron-FSDP keeps for its optimizer beside the
    main-grad buffer, or None where it keeps none: ``update_main_grads`` casts the shard to the main-weight
    buffer's dtype (:func:`megatron_code.megatron_fsdp_casts_grads_to_the_masters_dtype`), a new tensor where
    the two dtypes differ (0.19's bf16 buffer under fp32 masters; 0.16-0.18 without
    ``--accumulate-allreduce-grads-in-fp32``), none without a main-weight buffer (``auto``) or with the buffer in
    the masters' dtype (``.to`` of an equal dtype is the tensor itself). Megatron-FSDP's own masters only: the
    lean state (no main-weight buffer, decoupled gradients) keeps no copy."""
    from mindspeed_like.plan import megatron_code

    main = megatron_fsdp_main_params_dtype(precision)
    if main is None or main == megatron_fsdp_grad_dtype(precision) or megatron_fsdp_decoupled_grads(precision):
        return None
    return main if megatron_code.megatron_fsdp_casts_grads_to_the_masters_dtype() else None


def megatron_fsdp_decoupled_grads(precision: Precision) -> bool:
    """Whether Megatron-FSDP hands the optimizer its gradients as ``.decoupled_grad`` (the main-grad buffer's shard,
    uncast: no copy for the masters): under ``--use-precision-aware-optimizer`` where the release has
    ``megatron_fsdp_use_decoupled_grad`` (:func:`megatron_code.megatron_fsdp_has_decoupled_grad_field`: 0.18+,
    which Megatron-LM sets to that flag). Before 0.18 the combination is refused
    (:func:`megatron_fsdp_precision_aware_refusal`)."""
    from mindspeed_like.plan import megatron_code

    return precision.precision_aware_optimizer and megatron_code.megatron_fsdp_has_decoupled_grad_field()


def megatron_fsdp_precision_aware_refusal(precision: Precision) -> str | None:
    """Why megatron would train nothing with the precision-aware optimizer under Megatron-FSDP, or None: before
    0.18 nothing hands that Adam (``use_decoupled_grad``) a gradient (:func:`megatron_code.
    megatron_fsdp_has_decoupled_grad_field`)."""
    from mindspeed_like.plan import megatron_code

    if not precision.precision_aware_optimizer or megatron_code.megatron_fsdp_has_decoupled_grad_field():
        return None
    return (
        f"--use-precision-aware-optimizer with --use-megatron-fsdp on megatron-core {megatron_code.release()}: its "
        "Megatron-FSDP writes the gradients to .grad (update_main_grads writes .decoupled_grad only where the buffer's "
        "use_precision_aware_optimizer attribute is set, and nothing in megatron-core sets it), and the "
        "precision-aware Adam reads .decoupled_grad, so no weight is updated; megatron-core 0.18 and later hand them "
        "over (megatron_fsdp_use_decoupled_grad). Leave the flag out (megatron-fsdp-lean-state, --optimization-level "
        "2, runs the precision-aware Adam over Megatron-FSDP with that link made), or use megatron-core 0.18+"
    )


def megatron_fsdp_optimizer_grad_dtype(precision: Precision) -> str:
    """The dtype of the ``.grad`` Megatron-FSDP hands its optimizer's parameters (``update_main_grads``): the
    gradient shard cast to the main-weight buffer's dtype, or without one the main-grad buffer's own."""
    return megatron_fsdp_main_params_dtype(precision) or megatron_fsdp_grad_dtype(precision)


def megatron_fsdp_dtype_refusal(precision: Precision, clip_grad: float) -> str | None:
    """Why megatron stops a Megatron-FSDP run at its first step for its buffer dtypes, or None:

    - without a main-weight buffer (``auto``) the optimizer steps the weights' shard and ``update_main_grads``
      assigns it the main-grad buffer's shard as ``.grad`` uncast, which torch refuses where the dtypes differ
      ("attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype 'BFloat16'": a bf16 model
      with ``--megatron-fsdp-main-grads-dtype fp32``);
    - with gradient clipping (``--clip-grad`` > 0, Megatron-LM's default 1.0) megatron asserts each optimizer
      parameter's ``.grad`` is fp32 (:func:`megatron_code.clip_asserts_fp32_grads`), which a bf16 or fp16
      main-weight buffer, or none over bf16 or fp16 gradients, does not give
      (:func:`megatron_fsdp_optimizer_grad_dtype`)."""
    from mindspeed_like.plan import megatron_code

    given = f"--megatron-fsdp-main-params-dtype {precision.fsdp_main_params}" + (
        f" --megatron-fsdp-main-grads-dtype {precision.fsdp_main_grads}" if precision.fsdp_main_grads != "auto" else ""
    )
    grad = megatron_fsdp_optimizer_grad_dtype(precision)
    if megatron_fsdp_decoupled_grads(precision):
        # .decoupled_grad: the main-grad buffer's shard uncast; megatron's clipping takes it fp32 or bf16
        # (clip_grad_by_total_norm_fp32: 'assert param.decoupled_grad.dtype in [torch.float32, torch.bfloat16]')
        grad = megatron_fsdp_grad_dtype(precision)
        if clip_grad > 0 and grad not in ("fp32", "bf16"):
            return (
                f"--use-precision-aware-optimizer hands Megatron-FSDP's optimizer {grad} decoupled gradients "
                f"({given}), and megatron's gradient clipping (--clip-grad {clip_grad:g}) asserts fp32 or bf16 ones "
                "at the first step (clip_grad_by_total_norm_fp32): give --megatron-fsdp-main-grads-dtype fp32 or "
                "bf16, or --clip-grad 0"
            )
        return None
    if megatron_fsdp_main_params_dtype(precision) is None and grad != precision.params:
        return (
            f"{given} hands Megatron-FSDP's optimizer the {precision.params} weights' shard with a {grad} gradient "
            "(no main-weight buffer: update_main_grads assigns the main-grad buffer's shard to .grad uncast), and "
            f"torch refuses a gradient of another dtype than its parameter ('attempting to assign a gradient with "
            f"dtype ...'): give --megatron-fsdp-main-grads-dtype {precision.params} or auto, or a main-weight buffer"
        )
    if clip_grad <= 0 or grad == "fp32" or not megatron_code.clip_asserts_fp32_grads():
        return None
    return (
        f"{given} hands Megatron-FSDP's optimizer {grad} gradients, and megatron's gradient clipping (--clip-grad "
        f"{clip_grad:g}) asserts fp32 ones at the first step ('assert param.grad.type() == 'torch.cuda.FloatTensor'', "
        "clip_grad_by_total_norm_fp32 in optimizer/clip_grads.py): use --megatron-fsdp-main-params-dtype fp32, or "
        "fp32 gradients with auto (--megatron-fsdp-main-grads-dtype fp32), or --clip-grad 0"
    )


def expert_data_parallel_size(*, tp: int, cp: int, dp: int, expert_tp: int, ep: int) -> int | None:
    """megatron's expert data-parallel size, TP x CP x DP / (expert TP x EP), or None where it does not
    divide (megatron's initialize_model_parallel refuses that layout)."""
    ranks, experts = tp * cp * dp, expert_tp * ep
    return ranks // experts if ranks % experts == 0 else None


def hybrid_sharding_refusal(
    *,
    megatron_fsdp: bool,
    instances: int,
    outer: str,
    strategy: str,
    dp_cp: int,
    ep: int,
    overlap_grad_reduce: bool,
    expert_dp: int | None = None,
) -> str | None:
    """Why megatron (or this library's fix) refuses a Megatron-FSDP HSDP layout, or None: the words
    of the check that refuses it, and what to change. ``expert_dp``: the expert data-parallel size (TP x
    CP x DP / (expert TP x EP)), which the instances must divide too."""
    if instances < 1:
        return f"--num-distributed-optimizer-instances must be 1 or more, got {instances}"
    if outer != "no_shard" and not (megatron_fsdp and instances > 1):
        return (
            f"--outer-dp-sharding-strategy {outer} acts with --use-megatron-fsdp --num-distributed-optimizer-instances "
            "> 1 (hybrid sharding); give both, or leave it out"
        )
    if dp_cp % instances:
        return (
            f"--num-distributed-optimizer-instances {instances} does not divide DP x CP ({dp_cp}): megatron-core's "
            "initialize_model_parallel asserts 'Data parallel size should be divisible by partial DistOpt shard "
            "factor'"
        )
    if expert_dp is not None and expert_dp % instances:
        return (
            f"--num-distributed-optimizer-instances {instances} does not divide the expert data-parallel size "
            f"({expert_dp}: TP x CP x DP / (expert TP x EP)): megatron-core's initialize_model_parallel asserts "
            "'Expert data parallel size should be divisible by partial DistOpt shard factor'"
        )
    if not megatron_fsdp or instances == 1:
        return None
    if outer == "optim" and strategy != "optim_grads_params":
        return (
            f"--outer-dp-sharding-strategy optim with --data-parallel-sharding-strategy {strategy}: Megatron-LM: 'The "
            '"optim" option is only supported when --data-parallel-sharding-strategy is "optim_grads_params"\'; use '
            "optim_grads_params"
        )
    from mindspeed_like.fixes.megatron_fsdp_hsdp_experts import refusal as experts_refusal
    from mindspeed_like.plan import megatron_code

    # where the release (the installed one, or a record's the plan predicts) builds no expert mesh under HSDP
    refused = experts_refusal(instances, ep, _expert_mesh_under_hsdp(), str(megatron_code.release() or ""))
    if refused:
        return refused
    from mindspeed_like.fixes.megatron_fsdp_hsdp_grad_reduce import DELAYED, NO_OVERLAP

    if strategy in DELAYED and not overlap_grad_reduce:
        return NO_OVERLAP.format(instances=instances, strategy=strategy)
    return None


def units(run: Run, params: list[Param]) -> list[Unit]:
    """The FSDP units of one model chunk, in forward order (the root's last)."""
    lay = run.layout
    found: dict[str, list[Param]] = {}
    for p in params:
        found.setdefault(_unit_of(run, p), []).append(p)
    if lay.fsdp == MEGATRON_FSDP:
        # Megatron-FSDP makes TransformerLayers units (optim_grads_params only); the rest is bucketed
        found = {name: ps for name, ps in found.items() if name.startswith("layer ")} | {
            "not in a unit": [p for name, ps in found.items() if not name.startswith("layer ") for p in ps]
        }
    return [Unit(name, tuple(ps)) for name, ps in found.items() if ps]


def _unit_of(run: Run, p: Param) -> str:
    name = p.name
    if name.startswith("decoder.layers."):
        return f"layer {name.split('.')[2]}"
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("output_layer.") and run.transformer_impl != "local":
        return "output layer"
    return "root"


def shard(numel: int, group: int) -> int:
    """One rank's elements of a parameter sharded over ``group`` ranks (the shard is padded to equal
    size on every rank; FSDP2 pads the first dimension, Megatron-FSDP the group's buffer)."""
    return math.ceil(numel / group)


def gathered(run: Run, param: Param) -> bool:
    """Whether the FSDP path all-gathers ``param`` for its unit: every parameter under torch FSDP2; under
    Megatron-FSDP only one whose model-weight buffer is sharded, i.e. whose shard group has more than one
    rank (megatron-core 0.16.1 ``ParamAndGradBuffer._init_each_parameter_group_buffers``:
    ``is_data_distributed=... and model_wbuf_dp_group.size() > 1``; an unsharded buffer holds the whole
    bucket, the module's parameters are views of it, counted as weights, and ``free_bucket_storage``
    frees nothing). An expert's group is its expert data-parallel group: at DP 2 x EP 2 on 2 ranks one
    rank, so the experts are never gathered (compare, moe EP2 x DP2 optim_grads_params: the experts'
    bf16 buffer 4,325,376 bytes a layer, not distributed, on both ranks)."""
    if run.layout.fsdp != MEGATRON_FSDP:
        return True
    return hybrid_groups(run, param.expert)[0] > 1


def _saved_whole(run: Run, paths: Paths | None, param: Param) -> bool:
    """Whether autograd saves a view of ``param`` itself (so that its gathered bucket stays alive to the
    unit's backward). Every expert's weight is (the te-backend's grouped GEMM keeps the experts' own
    weights, as the local spec's GroupedMLP / SequentialMLP keep views of theirs: read in the code, not
    measured under Megatron-FSDP with expert data parallelism), but under moe-zero-memory, which saves
    no expert weight. Until the te-backend's grouped linear stopped stacking the weights into a new
    tensor for its GEMM, the TE spec's experts saved that copy instead and their bucket was freed after
    the unit's forward (compare, moe EP2 x DP2 under Megatron-FSDP, expert DP 1: the saved expert
    weights were [4, 1408, 256] / [4, 256, 704] stacked copies, none in a bucket)."""
    if not param.expert:
        return True
    return not (paths is not None and paths.moe_zero_memory)


def gathered_unit_bytes(run: Run, chunks: list[list[Param]]) -> tuple[int, str]:
    """The largest FSDP unit's gathered (unsharded) parameters, in the model dtype, and its name (a
    parameter the path does not gather, :func:`gathered`, left out)."""

    def size(unit: Unit) -> int:
        return sum(p.numel for p in unit.params if gathered(run, p))

    biggest = max((u for params in chunks for u in units(run, params) if u.name != "not in a unit"), key=size)
    return BYTES[run.precision.params] * size(biggest), biggest.name


def in_flight_bytes(run: Run, chunks: list[list[Param]], paths: Paths | None = None) -> tuple[int, str]:
    """What sharded data parallelism adds beside the activations at a step's busiest moment, on top
    of the model state: torch FSDP2's backward holds this unit's and the prefetched unit's gathered
    parameters and this unit's unsharded gradients (model dtype: three times the largest unit).
    Megatron-FSDP under optim_grads_params: the parameters outside its units (embedding, output
    layer, final norm), gathered whole for the step, and the prefetched unit's bucket (the units'
    buckets kept from forward to backward are in the activations, :func:`saved_gathered_bytes`).
    Under the other strategies the weights are whole all run (counted as weights): nothing."""
    lay = run.layout
    if lay.fsdp == TORCH_FSDP2:
        unit, name = gathered_unit_bytes(run, chunks)
        forward, backward = paths.fsdp_prefetch if paths is not None else (0, 0)
        # fsdp2-config's explicit prefetch: forward holds the unit and the next `forward` ones; backward the
        # unit, the `backward` earlier ones (FSDP2's own default: one) and the unit's unsharded gradients
        units_held = max(1 + forward, 2 + max(1, backward))
        ahead = f"{max(1, backward)} prefetched" if units_held == 2 + max(1, backward) else f"{forward} prefetched"
        return units_held * unit, (
            f"FSDP2: the gathered parameters of the largest unit ({name}) and of {ahead} unit(s)"
            + (", and its unsharded gradients (backward)" if units_held == 2 + max(1, backward) else " (forward)")
        )
    if lay.fsdp == MEGATRON_FSDP and lay.sharding_strategy == "optim_grads_params":
        unit, name = gathered_unit_bytes(run, chunks)
        rest = BYTES[run.precision.params] * sum(
            u.numel for params in chunks for u in units(run, params) if u.name == "not in a unit"
        )
        return unit + rest, (
            f"Megatron-FSDP: the parameters outside its units, gathered whole, and the prefetched bucket of the "
            f"largest unit ({name})"
        )
    return 0, ""


def saved_gathered_bytes(run: Run, params: list[Param], paths: Paths | None = None) -> list[tuple[str, int]]:
    """(unit, bytes) of the gathered parameters alive from a unit's forward to its backward that
    autograd saves (compare's activation probe counts a saved storage alive when the forward ends):

    - torch FSDP2 without reshard_after_forward: every unit's but the embedding's (its table is not
      saved: its backward reads the token ids), the root's (final norm) included; a norm's weight
      only where megatron's own RMSNorm/LayerNorm runs (fused-rmsnorm's kernel saves no weight).
      With reshard_after_forward every unit, the root included, is freed after its forward: none
      (compare's records: exact to the byte both ways).
    - Megatron-FSDP optim_grads_params, where the release gathers them again at the forward's end
      (:func:`megatron_code.megatron_fsdp_regathers_the_units_at_the_forward_end`: 0.16, 0.17; the output
      layer's all-gather prefetches them): every TransformerLayer's gathered bucket, whole, as measured on
      the largest rank (one rank of two held one layer's, the other both). 0.18 and 0.19 gather the
      parameters outside the units without prefetch from the second step on: none (compare's llama DP 2 on
      0.19.2, megatron's arm: 29,248,000 bytes, what ``optim`` keeps). A layer's experts are a bucket of
      their own (their own parameter group): counted only where they are gathered (:func:`gathered`: not at expert
      data-parallel size 1) and autograd saves them (:func:`_saved_whole`: not under moe-zero-memory).
      compare's moe EP2 x DP2 (expert DP 1): the saved gathered storages were the dense buckets only
      (332,800 bytes each); counting each layer's experts (4,325,376 bytes) there put megatron's arm 18%
      above the measured mean rank."""
    lay = run.layout
    p = BYTES[run.precision.params]
    if lay.fsdp == MEGATRON_FSDP and lay.sharding_strategy == "optim_grads_params":
        from mindspeed_like.plan import megatron_code

        if not megatron_code.megatron_fsdp_regathers_the_units_at_the_forward_end():
            return []
        return [
            (u.name, p * sum(q.numel for q in u.params if gathered(run, q) and _saved_whole(run, paths, q)))
            for u in units(run, params)
            if u.name.startswith("layer ")
        ]
    reshard = lay.reshard_after_forward
    if paths is not None and paths.fsdp_reshard_after_forward is not None:
        reshard = paths.fsdp_reshard_after_forward  # fsdp2-config's own key (the features arm)
    if lay.fsdp != TORCH_FSDP2 or reshard:
        return []
    fused_norm = paths is not None and paths.fused_rmsnorm
    out = []
    for unit in units(run, params):
        if unit.name == "embedding":
            continue
        kept = sum(q.numel for q in unit.params if not (fused_norm and _is_norm(q)))
        out.append((unit.name, p * kept))
    return out


def _is_norm(param: Param) -> bool:
    return "layernorm" in param.name or "layer_norm" in param.name or "norm." in param.name
