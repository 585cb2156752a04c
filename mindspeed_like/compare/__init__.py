"""`mindspeed-like compare`: the same model, data and seed trained twice, megatron-core's own
path and then with the features, each in its own process(es); one table, compare.json and a plot.

    mindspeed-like compare --preset llama --optimization-level 2 --steps 10 --out runs/llama

No feature flag and no level given means level 2 (every feature that applies). Parallel sizes
(``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``, ``--context-parallel-size``,
``--data-parallel-size``) run TP x PP x CP x DP processes per arm; a combination megatron-core would
refuse is refused here, before any process starts (``check_arguments``). The two arms run
alternately ``--repeats`` times (megatron, features, megatron, ...): the ratios are the median of
the per-repeat ratios, with their min and max.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from mindspeed_like.compare.arguments import (  # noqa: F401 (re-exported: the CLI and demo use them)
    DEFAULT_LEVEL,
    DEFAULT_REPEATS,
    SHARED_FLAGS,
    TRANSFORMER_IMPLS,
    add_compare_arguments,
    data_parallel_path,
    grad_reduce_in_fp32,
    optimizer_options,
    virtual_stages,
)
from mindspeed_like.compare.presets import PRESETS
from mindspeed_like.toolkit.errors import ConfigError


class CompareFailed(RuntimeError):
    """One arm's training failed in its process(es); the message carries their tracebacks."""


def world_size(args: argparse.Namespace) -> int:
    """Processes per arm: TP x PP x CP x DP, megatron's decomposition of the world."""
    return (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
        * args.data_parallel_size
    )


def check_arguments(args: argparse.Namespace, flag_values: dict[str, Any] | None = None) -> None:
    """Refuse, before any process starts, what megatron-core would refuse later deep inside a child:
    Megatron-LM's ``validate_args`` checks of the layout (quoted), megatron's TransformerConfig built
    here from the same values as the children's (its ``__post_init__`` errors surface as they are),
    its ``initialize_model_parallel`` world decomposition, and what the batch split and the
    context-parallel attention need."""
    flag_values = flag_values or {}
    for name in (
        "steps",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "data_parallel_size",
        "expert_model_parallel_size",
        "num_layers_per_virtual_pipeline_stage",
        "repeats",
        "threads",
    ):
        value = getattr(args, name)
        if (name == "threads" and value == 0) or (name == "num_layers_per_virtual_pipeline_stage" and value is None):
            continue
        if value <= 0:
            raise ConfigError(f"compare: --{name.replace('_', '-')} must be positive, got {value}")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(
            f"compare: --hidden-size {args.hidden_size} must be divisible by --num-attention-heads "
            f"{args.num_attention_heads}"
        )
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if args.sequence_parallel and tp == 1:
        raise ConfigError("compare: --sequence-parallel needs --tensor-model-parallel-size > 1")
    preset = PRESETS[args.preset]
    ep = args.expert_model_parallel_size
    if ep > 1 and not preset.moe:
        moe_presets = ", ".join(sorted(name for name, p in PRESETS.items() if p.moe))
        raise ConfigError(f"compare: --expert-model-parallel-size is for the MoE presets ({moe_presets})")
    if ep > 1 and preset.num_experts % ep:
        raise ConfigError(
            f"compare: --expert-model-parallel-size {ep} must divide the {preset.num_experts} experts of --preset "
            f"{preset.name}"
        )
    if (args.data_parallel_size * cp) % ep:
        # initialize_model_parallel: world % (expert TP x EP x PP) == 0, expert TP = TP here
        raise ConfigError(
            f"compare: megatron-core refuses this layout: world size {world_size(args)} is not divisible by expert "
            f"tensor parallel size ({tp}) x expert model parallel size ({ep}) x pipeline model parallel size ({pp}) "
            f"(initialize_model_parallel): --expert-model-parallel-size must divide DP x CP "
            f"({args.data_parallel_size} x {cp})"
        )
    if preset.name == "deepseek":
        head_dim = args.hidden_size // args.num_attention_heads
        if head_dim < 4 or head_dim % 2:
            raise ConfigError(
                f"compare: --preset deepseek needs hidden-size / num-attention-heads even and >= 4 (MLA's rope "
                f"part is half the head dim), got {head_dim}"
            )
    _check_pipeline(args)
    _check_sharded_data_parallel(args)
    _check_megatron_config(args)  # heads and query groups by TP, MoE sizes, ... in megatron's words
    _check_context_parallel(args, flag_values)


def _check_pipeline(args: argparse.Namespace) -> None:
    """Megatron-LM's validate_args checks of PP and virtual stages, with its messages."""
    pp, per_virtual = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    if args.num_layers % pp:
        raise ConfigError(
            f"compare: megatron refuses --num-layers {args.num_layers} at --pipeline-model-parallel-size {pp}: "
            "'Number of layers should be divisible by the pipeline-model-parallel size'"
        )
    if per_virtual is not None:
        if (args.num_layers // pp) % per_virtual:
            raise ConfigError(
                f"compare: megatron refuses --num-layers-per-virtual-pipeline-stage {per_virtual} with "
                f"{args.num_layers // pp} layers per pipeline stage: 'number of layers per pipeline stage must be "
                "divisible number of layers per virtual pipeline stage'"
            )
        if virtual_stages(args) is not None and pp == 1:
            raise ConfigError(
                "compare: megatron refuses virtual pipeline stages at --pipeline-model-parallel-size 1: 'When "
                "interleaved schedule is used, pipeline-model-parallel size should be greater than 1'"
            )
    if pp > 1 and args.preset == "deepseek":
        raise ConfigError(
            "compare: --preset deepseek with --pipeline-model-parallel-size > 1 is not supported by compare (its "
            "dense-first block spec and MTP layer are not placed per pipeline stage here); use another preset"
        )


def _check_sharded_data_parallel(args: argparse.Namespace) -> None:
    """Megatron-LM's validate_args checks of --use-torch-fsdp2 and --use-megatron-fsdp (quoted), the
    options that act only with one of them, the Megatron-FSDP strategy refused on this release, and the
    hybrid-sharding (HSDP) layouts megatron refuses or cannot run (``plan.fsdp.hybrid_sharding_refusal``)."""
    if args.use_torch_fsdp2 and args.use_megatron_fsdp:
        raise ConfigError("compare: --use-torch-fsdp2 and --use-megatron-fsdp are two FSDP paths; choose one")
    if args.torch_fsdp2_no_reshard_after_forward and not args.use_torch_fsdp2:
        raise ConfigError("compare: --torch-fsdp2-no-reshard-after-forward acts with --use-torch-fsdp2; give both")
    if args.data_parallel_sharding_strategy != "no_shard" and not args.use_megatron_fsdp:
        raise ConfigError(
            f"compare: --data-parallel-sharding-strategy {args.data_parallel_sharding_strategy} acts with "
            "--use-megatron-fsdp; give both"
        )
    from mindspeed_like.plan.fsdp import expert_data_parallel_size, hybrid_sharding_refusal
    from mindspeed_like.plan.megatron_args import check_megatron_fsdp_dtypes

    check_megatron_fsdp_dtypes(
        args.use_megatron_fsdp,
        getattr(args, "megatron_fsdp_main_params_dtype", "fp32"),
        getattr(args, "megatron_fsdp_main_grads_dtype", "auto"),
        "compare",
    )

    instances = getattr(args, "num_distributed_optimizer_instances", 1)
    refusal = hybrid_sharding_refusal(
        megatron_fsdp=args.use_megatron_fsdp,
        instances=instances,
        outer=getattr(args, "outer_dp_sharding_strategy", "no_shard"),
        strategy=args.data_parallel_sharding_strategy,
        dp_cp=args.data_parallel_size * args.context_parallel_size,
        ep=args.expert_model_parallel_size,
        overlap_grad_reduce=False,  # compare's workers run megatron's default (no --overlap-grad-reduce)
        expert_dp=expert_data_parallel_size(  # compare's expert TP is megatron's default, TP
            tp=args.tensor_model_parallel_size,
            cp=args.context_parallel_size,
            dp=args.data_parallel_size,
            expert_tp=args.tensor_model_parallel_size,
            ep=args.expert_model_parallel_size,
        ),
    )
    if refusal:
        raise ConfigError(f"compare: {refusal}")
    if instances != 1 and not args.use_megatron_fsdp:
        # the distributed optimizer's instances under DDP are Megatron-LM's too, but not a layout compare runs
        raise ConfigError(
            f"compare: --num-distributed-optimizer-instances {instances} runs here with --use-megatron-fsdp (its "
            "hybrid sharding); give it, or leave the option out"
        )
    if not (args.use_torch_fsdp2 or args.use_megatron_fsdp):
        return
    flag = "--use-torch-fsdp2" if args.use_torch_fsdp2 else "--use-megatron-fsdp"
    if args.pipeline_model_parallel_size > 1:
        # Megatron-LM refuses FSDP2 with PP; compare's pipeline schedule wraps its chunks in DDP
        raise ConfigError(
            f"compare: {flag} with --pipeline-model-parallel-size > 1: megatron refuses it for FSDP2 ('--use-torch-"
            "fsdp2 is not supported with pipeline parallelism') and compare trains pipeline stages under DDP only"
        )
    if args.use_torch_fsdp2:
        tied = PRESETS[args.preset].model_args(num_layers=1, hidden_size=8, num_attention_heads=1, seq_length=8)
        refusals = (
            (args.expert_model_parallel_size > 1, "'--use-torch-fsdp2 is not supported with expert parallelism'"),
            (args.use_distributed_optimizer, "'--use-torch-fsdp2 is not supported with MCore's distributed optimizer'"),
            (
                tied.get("share_embeddings_and_output_weights", False),
                f"'--use-torch-fsdp2 requires --untie-embeddings-and-output-weights' (--preset {args.preset} ties "
                "them)",
            ),
        )
        for refused, words in refusals:
            if refused:
                raise ConfigError(f"compare: megatron refuses this with --use-torch-fsdp2: {words}")
    if args.use_megatron_fsdp:
        from mindspeed_like.plan.compare_args import run_from_compare
        from mindspeed_like.plan.fsdp import megatron_fsdp_dtype_refusal, megatron_fsdp_precision_aware_refusal

        precision = run_from_compare(args, {}, "cpu").precision
        refused = megatron_fsdp_precision_aware_refusal(precision) or megatron_fsdp_dtype_refusal(
            precision, args.clip_grad
        )
        if refused:
            raise ConfigError(f"compare: {refused}")
    if args.use_megatron_fsdp and args.data_parallel_sharding_strategy == "no_shard":
        from mindspeed_like.fixes.megatron_fsdp_no_shard import refusal

        message = refusal()
        if message is not None:
            raise ConfigError(f"compare: --data-parallel-sharding-strategy no_shard: {message}")


def _check_context_parallel(args: argparse.Namespace, flag_values: dict[str, Any]) -> None:
    """The zigzag batch split (megatron's ``get_batch_on_this_cp_rank``: 2 x CP chunks of every
    sequence), the sequence-parallel scatter of each rank's chunks over TP, and the head split of
    the Ulysses all-to-all (docs/features/context-parallel.md)."""
    from mindspeed_like.features.context_parallel import CHOICES
    from mindspeed_like.features.context_parallel.groups import HYBRID, hierarchical_sizes

    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    algo = flag_values.get("context_parallel_algo") or CHOICES[0]
    degree = flag_values.get("ulysses_degree_in_cp")
    if cp == 1:
        if "context_parallel_algo" in flag_values or degree is not None:
            raise ConfigError(
                "compare: --context-parallel-algo / --ulysses-degree-in-cp act at --context-parallel-size > 1; "
                "give --context-parallel-size"
            )
        return
    if args.seq_length % (2 * cp):
        raise ConfigError(
            f"compare: --seq-length {args.seq_length} must be divisible by 2 x --context-parallel-size ({2 * cp}): "
            "megatron's get_batch_on_this_cp_rank splits every sequence into 2 x CP chunks"
        )
    if args.sequence_parallel and (args.seq_length // cp) % tp:
        raise ConfigError(
            f"compare: with --sequence-parallel, each context-parallel rank's {args.seq_length // cp} tokens must "
            f"be divisible by TP {tp} (megatron scatters them over the TP ranks)"
        )
    if algo in ("ulysses_cp_algo", HYBRID):
        ulysses = cp if algo == "ulysses_cp_algo" else degree
        if algo == HYBRID:
            if degree is None:
                raise ConfigError("compare: --context-parallel-algo hybrid_cp_algo needs --ulysses-degree-in-cp N")
            hierarchical_sizes(degree, cp)  # the degree divides CP (its ConfigError names the divisors)
        from mindspeed_like.compare.presets import PRESETS

        model = PRESETS[args.preset].model_args(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            seq_length=args.seq_length,
        )
        groups = model.get("num_query_groups") or args.num_attention_heads
        for what, count in (("attention heads", args.num_attention_heads), ("key/value groups", groups)):
            per_rank = max(1, count // tp)  # megatron lets query groups divide TP (each rank holds one)
            if per_rank % ulysses:
                raise ConfigError(
                    f"compare: {algo} moves heads with an all-to-all over {ulysses} ranks: the {per_rank} {what} per "
                    f"TP rank ({count} at TP {tp}) must be divisible by {ulysses}; use megatron_cp_algo (ring) or "
                    "kvallgather_cp_algo, or other sizes"
                )


def _check_megatron_config(args: argparse.Namespace) -> None:
    """megatron's TransformerConfig of the children's model, built here: its own checks
    (heads and query groups by TP, MoE by EP, pipeline dtype, ...) refuse with megatron's words."""
    from mindspeed_like.compare.worker import megatron_config

    try:
        megatron_config(_spec_layout(args))
    except (AssertionError, ValueError, TypeError) as error:
        raise ConfigError(f"compare: megatron-core's TransformerConfig refuses this combination: {error}") from error


def _spec_layout(args: argparse.Namespace) -> dict[str, Any]:
    """The part of a worker spec that decides the model and its layout."""
    pp = args.pipeline_model_parallel_size
    return dict(
        preset=args.preset,
        size=dict(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            seq_length=args.seq_length,
        ),
        bf16=not args.fp32,
        tp=args.tensor_model_parallel_size,
        sp=args.sequence_parallel,
        ep=args.expert_model_parallel_size,
        pp=pp,
        vpp=virtual_stages(args),
        cp=args.context_parallel_size,
        microbatches=pp if pp > 1 else 1,
        # Megatron-FSDP's HSDP: megatron's parallel state builds the intra- and inter-instance groups
        instances=getattr(args, "num_distributed_optimizer_instances", 1),
    )


def feature_flags(flag_values: dict[str, Any]) -> dict[str, Any]:
    """The features arm's configure() values: the flags given, or level 2 when none switch
    anything (only flags both arms share given: --device, --strict, the context-parallel algorithm)."""
    chosen = dict(flag_values)
    if not set(chosen) - set(SHARED_FLAGS):
        chosen["optimization_level"] = DEFAULT_LEVEL
    return chosen


def flops_plan(args: argparse.Namespace, layout: dict[str, Any], sequences: int, device: str) -> dict[str, Any]:
    """Model FLOPs a step (compare/flops.py: the formula) and, on an accelerator in bf16, the
    device's bf16 matmul peak measured here, once, before the arms start (compare/peak.py). A peak
    that cannot be measured leaves MFU out and says why; it never stops the comparison."""
    from mindspeed_like.compare.flops import FORMULA, model_flops
    from mindspeed_like.compare.peak import ACCELERATORS, bf16_matmul_peak

    model = PRESETS[args.preset].model_args(**layout["size"])
    counted = model_flops(model)
    plan: dict[str, Any] = {
        "model_flops_per_step": counted.per_step(sequences),
        "sequences_per_step": sequences,
        "forward_flops_per_token_by_part": counted.parts,
        "attention_forward_flops_per_sequence": counted.per_sequence,
        "formula": FORMULA,
        "devices": world_size(args),
        "peak": None,
    }
    if device not in ACCELERATORS:
        plan["peak_skipped"] = f"no peak is claimed on a {device}: achieved FLOP/s only"
    elif args.fp32:
        plan["peak_skipped"] = "--fp32: the measured peak is bf16's"
    else:
        if not args.quiet:
            print("measuring the device's bf16 matmul peak (8192^3 GEMM) for model FLOP utilisation", flush=True)
        try:
            plan["peak"] = bf16_matmul_peak(device)
        except Exception as error:  # MFU is a reading of the run, not a reason to stop it
            plan["peak_skipped"] = f"the peak could not be measured: {type(error).__name__}: {error}"
            print(f"compare: {plan['peak_skipped']}; no model FLOP utilisation in this run", flush=True)
    return plan


def run_compare(args: argparse.Namespace, flag_values: dict[str, Any]) -> dict[str, Any]:
    """Run both arms ``--repeats`` times, alternately, and return the result (also written to
    ``args.out``, and to results/ with ``--record``)."""
    import torch

    from mindspeed_like import runtime
    from mindspeed_like.compare import report
    from mindspeed_like.compare.worker import FEATURES, MEGATRON, run_arm
    from mindspeed_like.demo_data import megatron_source_bytes, sample_windows
    from mindspeed_like.run_arguments import quiet_expected_warnings
    from mindspeed_like.toolkit.records import device_record_name
    from mindspeed_like.workloads import run_distributed
    from mindspeed_like.workloads.distributed import DistributedError

    quiet_expected_warnings()  # megatron's config, built here by the checks, says TE/Apex are absent
    check_arguments(args, flag_values)
    record = report.start_record(args, flag_values)  # the load average before anything runs
    # one bf16-GEMM decision (kernels/host_gemm.py's probe, run by the record) for every arm and repeat
    from mindspeed_like.kernels.host_gemm import pin_decision

    pin_decision()
    flags = feature_flags(flag_values)
    config = runtime.resolve_config(code=flags, argv=[])  # errors here, not in the children
    ctx = runtime.context_for(config)
    runtime.check_relations(ctx)
    if args.transformer_impl == "transformer_engine" and "te-backend" not in ctx.enabled_names:
        from mindspeed_like.toolkit import transformer_engine

        if not transformer_engine.installed():
            raise ConfigError(
                "compare: --transformer-impl transformer_engine needs TransformerEngine or the te-backend, which "
                "--no-te-backend switched off; drop --no-te-backend or use --transformer-impl local"
            )
    device = config["device"]
    resolved = ctx.device  # "auto" resolved: what the arms will run on
    # a run on an accelerator is its own record (results/compare-...-cuda.json), beside the CPU one
    record.name = device_record_name(record.name, resolved)
    record.set_device(resolved)
    world = world_size(args)
    layout = _spec_layout(args)
    global_batch = args.micro_batch_size * layout["microbatches"] * args.data_parallel_size
    generator = torch.Generator().manual_seed(args.seed)
    tokens = megatron_source_bytes()
    data = torch.stack([sample_windows(tokens, global_batch, args.seq_length, generator) for _ in range(args.steps)])
    spec = dict(
        layout,
        steps=args.steps,
        micro_batch_size=args.micro_batch_size,
        lr=args.lr,
        seed=args.seed,
        transformer_impl=args.transformer_impl,
        distributed_optimizer=args.use_distributed_optimizer,
        optimizer=optimizer_options(args),
        grad_reduce_in_fp32=grad_reduce_in_fp32(args),
        data_parallel=data_parallel_path(args)[0],
        ddp_options=data_parallel_path(args)[1],
        device=device,
        data=data,
        progress=not args.quiet,
        threads=args.threads or max(1, (os.cpu_count() or 1) // world),
        repeats=args.repeats,
        shared_flags={k: v for k, v in flag_values.items() if k in SHARED_FLAGS and k not in ("device", "strict")},
    )
    flops = flops_plan(args, layout, global_batch, resolved)
    backend = {"cuda": "nccl", "npu": "hccl"}.get(runtime.context_for(config).device, "gloo")
    runs: dict[str, list[dict[str, Any]]] = {MEGATRON: [], FEATURES: []}
    for repeat in range(args.repeats):
        for arm, arm_flags in ((MEGATRON, {}), (FEATURES, flags)):
            if not args.quiet:
                which = f" (repeat {repeat + 1}/{args.repeats})" if args.repeats > 1 else ""
                print(f"{arm}{which}: training {args.steps} steps in {world} process(es)", flush=True)
            try:
                ranks = run_distributed(
                    run_arm,
                    world,
                    dict(spec, arm=arm, flags=arm_flags, repeat=repeat),
                    timeout=args.timeout,
                    backend=backend,
                )
            except DistributedError as error:
                raise CompareFailed(f"the {arm} run failed:\n{error}") from error
            runs[arm].append(report.merge_ranks(ranks))
    result = report.build(args, flags, runs, flops)
    result["files"] = report.write(result, args.out, record, to_results=args.record)
    return result
