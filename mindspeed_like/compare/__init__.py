"""`mindspeed-like compare`: the same model, data and seed trained twice, megatron-core's own
path and then with the features, each in its own process(es); one table, compare.json and a plot.

    mindspeed-like compare --preset llama --optimization-level 2 --steps 10 --out runs/llama

No feature flag and no level given means level 2 (every feature that applies). Parallel sizes
(``--tensor-model-parallel-size``, ``--data-parallel-size``, ...) run that many processes per arm.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from mindspeed_like.compare.presets import PRESETS
from mindspeed_like.toolkit.errors import ConfigError

DEFAULT_LEVEL = 2
TRANSFORMER_IMPLS = ("transformer_engine", "local")


class CompareFailed(RuntimeError):
    """One arm's training failed in its process(es); the message carries their tracebacks."""


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    from mindspeed_like.run_arguments import add_model_arguments

    group = parser.add_argument_group("compare")
    group.add_argument("--preset", choices=sorted(PRESETS), default="llama", help="model family (default llama)")
    add_model_arguments(
        group, steps=8, num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256, micro_batch_size=4
    )
    group.add_argument("--fp32", action="store_true", help="train in fp32 (default: bf16 with fp32 masters)")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument("--data-parallel-size", type=int, default=1)
    group.add_argument("--expert-model-parallel-size", type=int, default=1, help="MoE presets: experts over DP ranks")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument(
        "--transformer-impl",
        choices=TRANSFORMER_IMPLS,
        default="transformer_engine",
        help="the layer spec both arms build: megatron's TE spec (Megatron-LM's default; without TransformerEngine "
        "on the te-backend, which megatron's arm runs with no acceleration on) or its local spec",
    )
    group.add_argument("--out", default="compare-out", help="directory for compare.json and compare.png")
    group.add_argument("--timeout", type=float, default=3600, help="seconds per arm before its processes are killed")
    group.add_argument("--quiet", action="store_true", help="no progress line per step")
    group.add_argument(
        "--threads", type=int, default=0, help="CPU threads per process (default: the host's cores / processes)"
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Clear errors for sizes megatron would refuse later, deep inside a child process."""
    for name in (
        "steps",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "tensor_model_parallel_size",
        "data_parallel_size",
        "expert_model_parallel_size",
        "threads",
    ):
        if name == "threads" and args.threads == 0:
            continue
        if getattr(args, name) <= 0:
            raise ConfigError(f"compare: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(
            f"compare: --hidden-size {args.hidden_size} must be divisible by --num-attention-heads "
            f"{args.num_attention_heads}"
        )
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads % tp:
        raise ConfigError(f"compare: --num-attention-heads {args.num_attention_heads} must be divisible by TP {tp}")
    if args.sequence_parallel and tp == 1:
        raise ConfigError("compare: --sequence-parallel needs --tensor-model-parallel-size > 1")
    if args.sequence_parallel and args.seq_length % tp:
        raise ConfigError(f"compare: --seq-length {args.seq_length} must be divisible by TP {tp} with SP")
    ep = args.expert_model_parallel_size
    preset = PRESETS[args.preset]
    if ep > 1 and not preset.moe:
        moe_presets = ", ".join(sorted(name for name, p in PRESETS.items() if p.moe))
        raise ConfigError(f"compare: --expert-model-parallel-size is for the MoE presets ({moe_presets})")
    if ep > 1 and ((args.data_parallel_size * tp) % ep or preset.num_experts % ep):
        raise ConfigError(
            f"compare: --expert-model-parallel-size {ep} must divide DP x TP and the {preset.num_experts} experts"
        )
    if preset.name == "deepseek":
        head_dim = args.hidden_size // args.num_attention_heads
        if head_dim < 4 or head_dim % 2:
            raise ConfigError(
                f"compare: --preset deepseek needs hidden-size / num-attention-heads even and >= 4 (MLA's rope "
                f"part is half the head dim), got {head_dim}"
            )


def feature_flags(flag_values: dict[str, Any]) -> dict[str, Any]:
    """The features arm's configure() values: the flags given, or level 2 when none switch
    anything (only --device / --strict given)."""
    chosen = dict(flag_values)
    if not set(chosen) - {"device", "strict"}:
        chosen["optimization_level"] = DEFAULT_LEVEL
    return chosen


def run_compare(args: argparse.Namespace, flag_values: dict[str, Any]) -> dict[str, Any]:
    """Run both arms and return the result (also written to ``args.out``)."""
    import torch

    from mindspeed_like import runtime
    from mindspeed_like.compare import report
    from mindspeed_like.compare.worker import FEATURES, MEGATRON, run_arm
    from mindspeed_like.demo_data import megatron_source_bytes, sample_windows
    from mindspeed_like.testing import run_distributed
    from mindspeed_like.testing.distributed import DistributedError

    check_arguments(args)
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
    world = args.tensor_model_parallel_size * args.data_parallel_size
    global_batch = args.micro_batch_size * args.data_parallel_size
    generator = torch.Generator().manual_seed(args.seed)
    tokens = megatron_source_bytes()
    data = torch.stack([sample_windows(tokens, global_batch, args.seq_length, generator) for _ in range(args.steps)])
    spec = dict(
        preset=args.preset,
        size=dict(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            seq_length=args.seq_length,
        ),
        steps=args.steps,
        micro_batch_size=args.micro_batch_size,
        lr=args.lr,
        bf16=not args.fp32,
        seed=args.seed,
        tp=args.tensor_model_parallel_size,
        sp=args.sequence_parallel,
        ep=args.expert_model_parallel_size,
        transformer_impl=args.transformer_impl,
        distributed_optimizer=args.use_distributed_optimizer,
        device=device,
        data=data,
        progress=not args.quiet,
        threads=args.threads or max(1, (os.cpu_count() or 1) // world),
    )
    backend = {"cuda": "nccl", "npu": "hccl"}.get(runtime.context_for(config).device, "gloo")
    arms = {}
    for arm, arm_flags in ((MEGATRON, {}), (FEATURES, flags)):
        if not args.quiet:
            print(f"{arm}: training {args.steps} steps in {world} process(es)", flush=True)
        try:
            ranks = run_distributed(
                run_arm, world, dict(spec, arm=arm, flags=arm_flags), timeout=args.timeout, backend=backend
            )
        except DistributedError as error:
            raise CompareFailed(f"the {arm} run failed:\n{error}") from error
        arms[arm] = report.merge_ranks(ranks)
    result = report.build(args, flags, arms)
    result["files"] = report.write(result, args.out)
    return result
