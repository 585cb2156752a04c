"""`mindspeed-like demo`: train a small megatron-core GPT through the adaptor on this machine.

The text is the installed megatron-core's own source code, byte-level (vocab 256), so the
demo needs no download and its loss means something: it falls from ln(256) = 5.55 as the
model learns Python.
"""

from __future__ import annotations

import argparse
import math
import resource
import time

import torch


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from mindspeed_like.compare.presets import PRESETS
    from mindspeed_like.run_arguments import add_model_arguments

    group = parser.add_argument_group("demo")
    add_model_arguments(
        group, steps=40, num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, micro_batch_size=8
    )
    group.add_argument("--bf16", action="store_true", help="bf16 mixed precision (Float16Module + fp32 master)")
    group.add_argument(
        "--preset", choices=sorted(PRESETS), default="llama", help="model family (default llama; see `compare`)"
    )
    group.add_argument(
        "--compare-steps",
        type=int,
        default=0,
        help="after training, run `mindspeed-like compare` with this many steps and print its one-line summary",
    )


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise SystemExit(f"mindspeed-like demo: --{name.replace('_', '-')} must be positive, got {value}")


def run_demo(args: argparse.Namespace, flag_values: dict) -> int:
    for name in ("steps", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size"):
        _positive(name, getattr(args, name))
    if args.hidden_size % args.num_attention_heads:
        raise SystemExit("mindspeed-like demo: --hidden-size must be divisible by --num-attention-heads")

    from mindspeed_like.run_arguments import quiet_expected_warnings

    quiet_expected_warnings()

    import mindspeed_like
    import mindspeed_like.megatron_adaptor  # noqa: F401  (the one line a user adds)

    config = mindspeed_like.configure(**flag_values)
    from mindspeed_like.adapters.detect import detect_device
    from mindspeed_like.compare.presets import PRESETS
    from mindspeed_like.compare.report import describe_features
    from mindspeed_like.demo_data import megatron_source_bytes, sample_windows
    from mindspeed_like.runtime import enabled_feature_names
    from mindspeed_like.testing import destroy_parallel, init_parallel, param_bytes, tiny_gpt, train_steps

    features_on = enabled_feature_names(config)
    print(f"mindspeed_like demo on {detect_device(config['device'])}: features on: {describe_features(features_on)}")
    tokens = megatron_source_bytes()
    generator = torch.Generator().manual_seed(args.seed)
    batches = torch.stack(
        [sample_windows(tokens, args.micro_batch_size, args.seq_length, generator) for _ in range(args.steps)]
    )
    print(
        f"data: {tokens.numel():,} bytes of megatron-core source; model: {args.preset} preset, "
        f"{args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, "
        f"seq {args.seq_length}, batch {args.micro_batch_size}, {'bf16' if args.bf16 else 'fp32'}"
    )

    init_parallel(seed=args.seed)
    try:
        preset = PRESETS[args.preset]
        model_args = preset.model_args(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            seq_length=args.seq_length,
        )
        if preset.moe:  # megatron's grouped experts where our grouped GEMM runs, else its expert loop
            model_args["moe_grouped_gemm"] = "grouped-gemm" in features_on
        model = tiny_gpt(bf16=args.bf16, **model_args)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"parameters: {n_params:,} ({param_bytes(list(model.parameters())) / 2**20:.1f} MiB)")
        start = time.perf_counter()
        last = [start]

        def progress(step: int, loss: float) -> None:
            now = time.perf_counter()
            print(f"step {step + 1:4d}/{args.steps}  loss {loss:.4f}  ({(now - last[0]) * 1000:.0f} ms)", flush=True)
            last[0] = now

        losses = train_steps(
            model,
            args.steps,
            data=batches,
            lr=args.lr,
            micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length,
            on_step=progress,
        )
        elapsed = time.perf_counter() - start
    finally:
        destroy_parallel()
    tokens_per_s = args.steps * args.micro_batch_size * args.seq_length / elapsed
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("summary:")
    print(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f} (uniform guess: {math.log(256):.4f})")
    print(f"  {tokens_per_s:,.0f} tokens/s over {args.steps} steps ({elapsed:.1f} s)")
    print(f"  peak memory (process RSS, includes the Python/torch runtime): {peak_rss:.0f} MiB")
    print(f"  features on: {describe_features(features_on)}")
    if not all(math.isfinite(x) for x in losses):
        print("demo FAILED: a loss is not finite")
        return 1
    if args.compare_steps > 0:
        return _compare_summary(args, flag_values)
    return 0


def _compare_summary(args: argparse.Namespace, flag_values: dict) -> int:
    """The default `mindspeed-like compare` at the demo's preset, summarised in one line."""
    from mindspeed_like.compare import add_compare_arguments, run_compare
    from mindspeed_like.compare.report import summary_line

    parser = argparse.ArgumentParser(prog="mindspeed-like compare")
    add_compare_arguments(parser)
    compare_args = parser.parse_args(
        # one repeat: the demo's summary line, not a measurement (`mindspeed-like compare` repeats 3 times)
        [
            "--preset",
            args.preset,
            "--steps",
            str(args.compare_steps),
            "--quiet",
            "--out",
            "compare-out",
            "--repeats",
            "1",
        ]
    )
    print(
        f"compare ({args.compare_steps} steps, one repeat, `mindspeed-like compare --preset {args.preset}` defaults "
        "otherwise):",
        flush=True,
    )
    result = run_compare(compare_args, flag_values)
    print("  " + summary_line(result))
    return 0
