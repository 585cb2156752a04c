"""compare's command-line arguments (its own options; the feature flags are added by the CLI).

Its own module so that the report (which names a record after the options not at their
defaults) and the package root both read them without importing each other.
"""

from __future__ import annotations

import argparse
from typing import Any

from mindspeed_like.compare.presets import PRESETS
from mindspeed_like.toolkit.cli_values import above, non_negative_int, output_directory, record_name

DEFAULT_LEVEL = 2
DEFAULT_REPEATS = 3
# flags both arms run with: the context-parallel algorithm is megatron's only CP attention on this host
SHARED_FLAGS = ("device", "strict", "context_parallel_algo", "ulysses_degree_in_cp")
TRANSFORMER_IMPLS = ("transformer_engine", "local")
# Megatron-LM's --data-parallel-sharding-strategy choices and default (megatron/training/arguments.py)
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# Megatron-LM's --outer-dp-sharding-strategy choices (Megatron-FSDP's HSDP), default no_shard
OUTER_SHARDING_STRATEGIES = ("no_shard", "optim")
# Megatron-LM's --exp-avg-dtype / --exp-avg-sq-dtype choices (the precision-aware optimizer's moments)
PRECISION_AWARE_DTYPES = ("fp32", "fp16", "bf16", "fp8")
# Megatron-LM's --megatron-fsdp-main-params-dtype / --megatron-fsdp-main-grads-dtype choices (0.17+; auto: None)
FSDP_MAIN_DTYPES = ("fp32", "bf16", "fp16", "auto")


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    from mindspeed_like.run_arguments import add_model_arguments

    group = parser.add_argument_group("compare")
    group.add_argument("--preset", choices=sorted(PRESETS), default="llama", help="model family (default llama)")
    add_model_arguments(
        group, steps=8, num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256, micro_batch_size=4
    )
    group.add_argument("--fp32", action="store_true", help="train in fp32 (default: bf16 with fp32 masters)")
    group.add_argument(
        "--clip-grad",
        type=float,
        default=1.0,
        help="gradient clipping by the global L2 norm, 0 for none (Megatron-LM's flag and default, 1.0), both arms",
    )
    group.add_argument(
        "--use-precision-aware-optimizer",
        action="store_true",
        help="megatron's precision-aware optimizer, both arms (Megatron-LM's flag; without TransformerEngine its "
        "Adam is precision-aware-optimizer's in both)",
    )
    for name, choices, default in (
        ("main-grads", ("fp32", "bf16"), "fp32"),
        ("main-params", ("fp32", "fp16"), "fp32"),
        ("exp-avg", PRECISION_AWARE_DTYPES, "fp32"),
        ("exp-avg-sq", PRECISION_AWARE_DTYPES, "fp32"),
    ):
        group.add_argument(
            f"--{name}-dtype",
            choices=choices,
            default=default,
            help=f"with --use-precision-aware-optimizer (Megatron-LM's flag and default, {default})",
        )
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="pipeline stages (megatron's 1F1B schedule; PP microbatches per step)",
    )
    group.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        default=None,
        help="virtual pipeline stages (megatron's interleaved schedule): layers per model chunk",
    )
    group.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="sequence split over ranks; the attention algorithm is --context-parallel-algo (both arms: it is "
        "the only CP attention megatron has without TransformerEngine)",
    )
    group.add_argument("--data-parallel-size", type=int, default=1)
    group.add_argument(
        "--expert-model-parallel-size", type=int, default=1, help="MoE presets: experts over DP x CP ranks"
    )
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="both arms under megatron's torch FSDP2 wrapper (TorchFullyShardedDataParallel), as Megatron-LM's flag",
    )
    group.add_argument(
        "--torch-fsdp2-no-reshard-after-forward",
        action="store_true",
        help="with --use-torch-fsdp2: keep each unit's gathered parameters from its forward to its backward (ZeRO-2)",
    )
    group.add_argument(
        "--use-megatron-fsdp",
        action="store_true",
        help="both arms under Megatron-FSDP (megatron's FullyShardedDataParallel, its distributed optimizer)",
    )
    group.add_argument(
        "--data-parallel-sharding-strategy",
        choices=SHARDING_STRATEGIES,
        default=SHARDING_STRATEGIES[0],
        help="with --use-megatron-fsdp: what is sharded over DP (Megatron-LM's flag and default, no_shard; "
        "optim_grads_params is ZeRO-3)",
    )
    group.add_argument(
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        help="with --use-megatron-fsdp: hybrid sharding (HSDP), as Megatron-LM's flag: each parameter sharded within "
        "one of N groups of DP x CP / N ranks and replicated across the N groups",
    )
    group.add_argument(
        "--outer-dp-sharding-strategy",
        choices=OUTER_SHARDING_STRATEGIES,
        default=OUTER_SHARDING_STRATEGIES[0],
        help="with --num-distributed-optimizer-instances > 1: optim also shards the fp32 masters and Adam's moments "
        "across the groups (Megatron-LM's flag and default, no_shard; optim needs optim_grads_params)",
    )
    for name, default, what in (
        (
            "main-params",
            "fp32",
            "main-weight buffer (the parameters its optimizer steps; auto: none, the weights' shard)",
        ),
        ("main-grads", "auto", "main-grad buffer (auto: the parameters' dtype)"),
    ):
        group.add_argument(
            f"--megatron-fsdp-{name}-dtype",
            choices=FSDP_MAIN_DTYPES,
            default=default,
            help=f"with --use-megatron-fsdp, megatron-core 0.17+: the dtype of its {what} (Megatron-LM's flag and "
            f"default, {default}), both arms",
        )
    group.add_argument(
        "--transformer-impl",
        choices=TRANSFORMER_IMPLS,
        default="transformer_engine",
        help="the layer spec both arms build: megatron's TE spec (Megatron-LM's default; without TransformerEngine "
        "on the te-backend, which megatron's arm runs with no acceleration on) or its local spec",
    )
    group.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"runs of each arm, alternating (default {DEFAULT_REPEATS}): ratios are the median of the per-repeat "
        "ratios, with their min-max",
    )
    group.add_argument(
        "--out", type=output_directory, default="compare-out", help="directory for compare.json and compare.png"
    )
    group.add_argument(
        "--record",
        nargs="?",
        const="",
        default=None,
        type=record_name,
        metavar="NAME",
        help="also write the record to results/NAME.json (default name: compare-<preset>[-<non-default options>])",
    )
    group.add_argument("--timeout", type=above(0), default=3600, help="seconds per arm before its processes are killed")
    group.add_argument("--quiet", action="store_true", help="no progress line per step")
    group.add_argument(
        "--threads",
        type=non_negative_int,
        default=0,
        help="CPU threads per process (default: the host's cores / processes)",
    )


def data_parallel_path(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """megatron's data-parallel wrapper both arms train under (``train_steps``'s ``data_parallel``)
    and its options, from Megatron-LM's flags."""
    if args.use_torch_fsdp2:
        return "torch_fsdp2", {"reshard_after_forward": not args.torch_fsdp2_no_reshard_after_forward}
    if args.use_megatron_fsdp:
        options: dict[str, Any] = {"data_parallel_sharding_strategy": args.data_parallel_sharding_strategy}
        instances = getattr(args, "num_distributed_optimizer_instances", 1)
        if instances > 1:  # HSDP (megatron's parallel state gets the same count: the worker's init_parallel)
            options.update(
                num_distributed_optimizer_instances=instances,
                outer_dp_sharding_strategy=args.outer_dp_sharding_strategy,
            )
        options.update(megatron_fsdp_dtype_fields(args))
        if getattr(args, "use_precision_aware_optimizer", False):
            from mindspeed_like.plan import megatron_code

            if megatron_code.megatron_fsdp_has_decoupled_grad_field():
                # Megatron-LM 0.18+: megatron_fsdp_use_decoupled_grad = --use-precision-aware-optimizer
                options["megatron_fsdp_use_decoupled_grad"] = True
        return "megatron_fsdp", options
    return "ddp", {}


def megatron_fsdp_dtype_fields(args: argparse.Namespace) -> dict[str, Any]:
    """``DistributedDataParallelConfig``'s Megatron-FSDP dtype fields of the options away from their defaults
    (Megatron-LM's ``validate_args`` mapping: ``auto`` is None), so that a run at the defaults builds the same
    config on every release, those without the fields (0.16) included."""
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "auto": None}
    out: dict[str, Any] = {}
    for field, default in (("megatron_fsdp_main_params_dtype", "fp32"), ("megatron_fsdp_main_grads_dtype", "auto")):
        value = getattr(args, field, default)
        if value != default:
            out[field] = dtypes[value]
    return out


_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "uint8"}
"""Megatron-LM's validate_args mapping of the dtype options (fp8 moments are uint8 tensors)."""


def optimizer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``OptimizerConfig`` fields of both arms beyond the workers' own: ``--clip-grad``, and the precision-aware
    optimizer's (``--use-precision-aware-optimizer`` and its dtypes, as Megatron-LM's ``validate_args`` maps them)."""
    import torch

    out: dict[str, Any] = {"optimizer": "adam", "clip_grad": getattr(args, "clip_grad", 1.0)}
    if getattr(args, "use_precision_aware_optimizer", False):
        out["use_precision_aware_optimizer"] = True
        for field in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            out[field] = getattr(torch, _TORCH_DTYPES[getattr(args, field)])
    return out


def grad_reduce_in_fp32(args: argparse.Namespace) -> bool:
    """Megatron-LM's ``accumulate_allreduce_grads_in_fp32`` for compare's runs: set for bf16 unless the precision-aware
    optimizer's main gradients are bf16 (``validate_args``); the workers' default otherwise."""
    return not (
        getattr(args, "use_precision_aware_optimizer", False) and getattr(args, "main_grads_dtype", "fp32") == "bf16"
    )


def virtual_stages(args: argparse.Namespace) -> int | None:
    """megatron's ``virtual_pipeline_model_parallel_size`` from ``--num-layers-per-virtual-pipeline-stage``
    (Megatron-LM's ``validate_args``: layers per stage / layers per virtual stage; 1 means none)."""
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return None
    vpp = args.num_layers // args.pipeline_model_parallel_size // per_stage
    return vpp if vpp > 1 else None
