"""`mindspeed-like demo`: train a small megatron-core GPT through the adaptor on this machine.

The text is the installed megatron-core's own source code, byte-level (vocab 256), so the
demo needs no download and its loss means something: it falls from ln(256) = 5.55 as the
model learns Python.

The model and every batch go to the resolved device (megatron builds the model on the host with
``use_cpu_initialization``, then it is moved, as `compare`'s worker does). The size is picked per
device (:data:`SIZES`): one where the features pay within the demo's time on that device, and the
closing `compare` line runs at the same size on the same device.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import time
from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class DemoSize:
    """The demo's model and run on one kind of device; ``why``: why this size, said in the output."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    micro_batch_size: int
    steps: int
    bf16: bool
    why: str


SIZES: dict[str, DemoSize] = {
    # Measured on this project's 2-core CPU, TORCHDYNAMO_DISABLE=1 as `make demo` runs, bf16, CPU time
    # per step (the host was loaded; CPU time does not depend on it): levels 1 / 2 against megatron's
    # own step at seq 1024 (4 layers, hidden 256, batch 1): 2.52x / 2.12x (772 ms -> 306 / 365 ms);
    # at the former sizes, seq 256 batch 4: 1.08x / 0.97x, seq 128 batch 8: 0.95x / 0.78x.
    "cpu": DemoSize(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        seq_length=1024,
        micro_batch_size=1,
        steps=30,
        bf16=False,
        why="at seq 1024 megatron's attention holds a [heads, seq, seq] score tensor per layer that "
        "flash-attention never builds; at seq 128-256 a CPU step is too small for the features to pay",
    ),
    # The first H100 run (issue 36): level 1 gave 1.62x megatron's tokens/s at this size, bf16.
    "cuda": DemoSize(
        num_layers=8,
        hidden_size=2048,
        num_attention_heads=16,
        seq_length=4096,
        micro_batch_size=1,
        steps=20,
        bf16=True,
        why="the size of the first H100 measurement (level 1: 1.62x megatron's tokens/s, bf16)",
    ),
}
SIZES["npu"] = replace(SIZES["cuda"], why="the accelerator size (as on CUDA); not measured on an NPU yet")
_SIZE_ARGUMENTS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "steps")


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from mindspeed_like.compare.presets import PRESETS
    from mindspeed_like.toolkit.cli_values import at_least

    group = parser.add_argument_group("demo")
    for name in _SIZE_ARGUMENTS:
        option = "--" + name.replace("_", "-")
        group.add_argument(option, type=int, default=None, help="(default: per device, see `demo --help` epilog)")
    group.add_argument("--lr", type=at_least(0), default=3e-3, help="learning rate, finite and >= 0 (default 3e-3)")
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 mixed precision (Float16Module + fp32 master); default: on for an accelerator, off on a CPU",
    )
    group.add_argument(
        "--preset", choices=sorted(PRESETS), default="llama", help="model family (default llama; see `compare`)"
    )
    group.add_argument(
        "--compare-steps",
        type=int,
        default=0,
        help="after training, run `mindspeed-like compare` at the demo's size and device with this many steps "
        "and print its one-line summary",
    )
    parser.epilog = "default sizes per device: " + "; ".join(
        f"{device}: {s.num_layers} layers, hidden {s.hidden_size}, {s.num_attention_heads} heads, seq {s.seq_length}, "
        f"micro batch {s.micro_batch_size}, {s.steps} steps, {'bf16' if s.bf16 else 'fp32'}"
        for device, s in SIZES.items()
    )


def demo_size(args: argparse.Namespace, device: str) -> DemoSize:
    """The device's size with the arguments given on the command line in place of its defaults."""
    size = SIZES.get(device, SIZES["cpu"])
    given = {f.name: getattr(args, f.name) for f in fields(DemoSize) if getattr(args, f.name, None) is not None}
    size = replace(size, **given)
    for name in _SIZE_ARGUMENTS:
        value = getattr(size, name)
        if value <= 0:
            raise SystemExit(f"mindspeed-like demo: --{name.replace('_', '-')} must be positive, got {value}")
    if size.hidden_size % size.num_attention_heads:
        raise SystemExit("mindspeed-like demo: --hidden-size must be divisible by --num-attention-heads")
    return size


def build_model(preset_name: str, size: DemoSize, features_on: list[str]) -> torch.nn.Module:
    """The preset's GPT at ``size``, built by megatron on the host (``use_cpu_initialization``, as
    ``workloads.tiny_gpt`` does). MoE: megatron's grouped experts where our grouped GEMM runs, else
    its expert loop."""
    from mindspeed_like.compare.presets import PRESETS
    from mindspeed_like.workloads import tiny_gpt

    preset = PRESETS[preset_name]
    model_args = preset.model_args(
        num_layers=size.num_layers,
        hidden_size=size.hidden_size,
        num_attention_heads=size.num_attention_heads,
        seq_length=size.seq_length,
    )
    if preset.moe:
        model_args["moe_grouped_gemm"] = "grouped-gemm" in features_on
    return tiny_gpt(bf16=size.bf16, **model_args)


def place_on_device(model: torch.nn.Module, device: str) -> tuple[torch.nn.Module, torch.device | None]:
    """The model moved to the device it trains on, and that device for the batches (None: the host).

    megatron builds it on the host, and megatron's own code then creates tensors on
    ``torch.cuda.current_device()`` (RoPE's frequencies at the first forward): a model left on the
    host mixes the two there (what the demo did before, found by ``testing.fake_cuda``)."""
    if device == "cpu":
        return model, None
    index = torch.cuda.current_device() if device == "cuda" else 0  # npu: torch_npu maps it (adapters/npu)
    target = torch.device(device, index)
    return model.to(target), target


def run_demo(args: argparse.Namespace, flag_values: dict) -> int:
    from mindspeed_like.run_arguments import quiet_expected_warnings

    quiet_expected_warnings()

    import mindspeed_like
    import mindspeed_like.megatron_adaptor  # noqa: F401  (the one line a user adds)

    config = mindspeed_like.configure(**flag_values)
    from mindspeed_like.compare.report import describe_features
    from mindspeed_like.demo_data import megatron_source_bytes, sample_windows
    from mindspeed_like.runtime import context_for, enabled_feature_names
    from mindspeed_like.workloads import destroy_parallel, init_parallel, param_bytes, train_steps

    device = context_for(config).device
    size = demo_size(args, device)
    features_on = enabled_feature_names(config)
    print(f"mindspeed_like demo on {device}: features on: {describe_features(features_on)}")
    tokens = megatron_source_bytes()
    generator = torch.Generator().manual_seed(args.seed)
    batches = torch.stack(
        [sample_windows(tokens, size.micro_batch_size, size.seq_length, generator) for _ in range(size.steps)]
    )
    print(
        f"data: {tokens.numel():,} bytes of megatron-core source; model: {args.preset} preset, "
        f"{size.num_layers} layers, hidden {size.hidden_size}, {size.num_attention_heads} heads, "
        f"seq {size.seq_length}, batch {size.micro_batch_size}, {'bf16' if size.bf16 else 'fp32'}"
    )

    _init_process_group(device)
    init_parallel(seed=args.seed)
    try:
        model = build_model(args.preset, size, features_on)
        model, target = place_on_device(model, device)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"parameters: {n_params:,} ({param_bytes(list(model.parameters())) / 2**20:.1f} MiB)")
        start = time.perf_counter()
        last = [start]

        def progress(step: int, loss: float) -> None:
            now = time.perf_counter()
            print(f"step {step + 1:4d}/{size.steps}  loss {loss:.4f}  ({(now - last[0]) * 1000:.0f} ms)", flush=True)
            last[0] = now

        losses = train_steps(
            model,
            size.steps,
            data=batches,
            lr=args.lr,
            micro_batch_size=size.micro_batch_size,
            seq_length=size.seq_length,
            device=target,
            on_step=progress,
        )
        elapsed = time.perf_counter() - start
    finally:
        destroy_parallel()
    tokens_per_s = size.steps * size.micro_batch_size * size.seq_length / elapsed
    print("summary:")
    print(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f} (uniform guess: {math.log(256):.4f})")
    print(f"  {tokens_per_s:,.0f} tokens/s over {size.steps} steps ({elapsed:.1f} s)")
    print(f"  {_peak_memory(device)}")
    print(f"  features on: {describe_features(features_on)}")
    if not all(math.isfinite(x) for x in losses):
        print("demo FAILED: a loss is not finite")
        return 1
    if args.compare_steps > 0:
        return _compare_summary(args, flag_values, size, device)
    return 0


def _init_process_group(device: str) -> None:
    """The one-process group megatron's parallel state is built on: NCCL on a GPU (as compare's arms
    run there; megatron's collectives get CUDA tensors), else gloo (``init_parallel``'s default)."""
    import torch.distributed as dist

    if device == "cuda" and dist.is_nccl_available() and not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)


def _peak_memory(device: str) -> str:
    if device in ("cuda", "npu"):
        from mindspeed_like.compare.measure import process_peak_bytes

        return f"peak memory ({device} allocator's max allocated): {process_peak_bytes(device) / 2**20:,.0f} MiB"
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return f"peak memory (process RSS, includes the Python/torch runtime): {peak_rss:,.0f} MiB"


def compare_command(args: argparse.Namespace, size: DemoSize, device: str) -> list[str]:
    """`mindspeed-like compare`'s arguments for the demo's closing line: the demo's preset, size and
    device (the feature flags travel separately), one repeat, compare's bf16 unless ``--no-bf16``
    was given (the precision the features are built for; the CPU demo trains in fp32 for speed)."""
    return [
        "--preset",
        args.preset,
        "--steps",
        str(args.compare_steps),
        "--num-layers",
        str(size.num_layers),
        "--hidden-size",
        str(size.hidden_size),
        "--num-attention-heads",
        str(size.num_attention_heads),
        "--seq-length",
        str(size.seq_length),
        "--micro-batch-size",
        str(size.micro_batch_size),
        *(["--fp32"] if getattr(args, "bf16", None) is False else []),
        "--quiet",
        "--out",
        "compare-out",
        "--repeats",
        "1",
    ]


def _compare_summary(args: argparse.Namespace, flag_values: dict, size: DemoSize, device: str) -> int:
    """`mindspeed-like compare` at the demo's preset, size and device, summarised in one line."""
    from mindspeed_like.compare import add_compare_arguments, run_compare
    from mindspeed_like.compare.report import summary_line

    parser = argparse.ArgumentParser(prog="mindspeed-like compare")
    add_compare_arguments(parser)
    command = compare_command(args, size, device)
    compare_args = parser.parse_args(command)
    why = f"; this size: {size.why}" if size == SIZES.get(device) else ""
    print(f"compare on {device} (one repeat, `mindspeed-like compare {' '.join(command[:-5])}`{why}):", flush=True)
    load = os.getloadavg()[0]
    result = run_compare(compare_args, dict(flag_values, device=device))
    load = max(load, os.getloadavg()[0])
    print("  " + summary_line(result))
    below = why_below_one(result, busy=load > (os.cpu_count() or 1), load=load)
    if below:
        print(f"  ({below})")
    return 0


def why_below_one(result: dict, *, busy: bool = False, load: float = 0.0) -> str:
    """One sentence for a tokens/s ratio below 1 (empty otherwise). A busy host (load average above
    its CPU count during the run) first: one repeat's arms ran at different moments of that load.
    Else the level-2 features that ran, which trade time for memory (:data:`mindspeed_like.levels.LEVELS`):
    measured on this project's CPU, level 2 costs time at seq 128-256 and pays at the demo's seq 1024."""
    from mindspeed_like import registry

    ratios = result["ratios"]
    if ratios["tokens_per_s"] is None or ratios["tokens_per_s"] >= 1:
        return ""
    if busy:
        return (
            f"below 1x: this host was busy (load average {load:.1f} on {os.cpu_count()} CPUs) and the two arms of one "
            "repeat ran at different moments of it; `mindspeed-like compare` alternates them over 3 repeats"
        )
    ran = set(result["features"]["ran"])
    trading = sorted(f.name for f in registry.all_features() if f.optimization_level == 2 and f.name in ran)
    if trading:
        return (
            f"below 1x: {', '.join(trading)} trade time for memory (activations {ratios['activations_bytes']:.2f}x "
            "of megatron's here), which a model this small does not need; --optimization-level 1 is the speed level"
        )
    return (
        "below 1x: at this size megatron's own kernels are as fast as the fused ones on this device; "
        "a longer --seq-length shows what the features are for"
    )
