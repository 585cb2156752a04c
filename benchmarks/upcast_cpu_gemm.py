"""upcast-cpu-gemm: a bf16 training step on a CPU whose bf16 GEMM is slow, against megatron's own
bf16 path and against fp32 steps, in the same run: training tokens/s and the losses.

Run it where the feature acts: an AVX2-only host, or any x86 host held to AVX2 (the probe in
kernels/host_gemm.py decides from the GEMM speed this process really gets)::

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/upcast_cpu_gemm.py --record upcast_cpu_gemm-avx2

On an AVX-512-BF16 host without the variables the probe finds bf16 fast: the feature stands aside
(its arms then equal the arms without it) and the record says so.

Each arm runs in a FRESH PROCESS (this script with ``--arm``): the feature's override is process-wide,
and an arm must not inherit another's oneDNN kernels or allocator state. Arms alternate over the
repeats. The features arms run ``--level`` (default 2, as `make demo` does; the default size is the
demo's CPU size). In each: the llama preset (compare/worker.py ``_build_model``, the same weights in every
arm), one untimed round (torch.compile of megatron's jit_fuser functions, ON unless
TORCHDYNAMO_DISABLE is set), then ``--steps`` timed steps after an untimed first one. Columns:
tokens/s; its ratio to megatron's bf16 arm; the step time over the same path's fp32 step (the
issue's "bf16 within 1.3x of fp32"); the loss after the timed round (the arms train the same data
from the same weights: bf16 arms agree within bf16 training noise, fp32 arms with each other).

    python benchmarks/upcast_cpu_gemm.py [--quick] [--repeats N] [--steps N] [--level 1|2]
        [--num-layers L] [--hidden-size H] [--num-attention-heads N] [--seq-length S] [--record NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import common  # benchmarks/ is the script directory (as in moe.py)

import mindspeed_like
from mindspeed_like.compare.worker import _build_model
from mindspeed_like.kernels import host_gemm
from mindspeed_like.testing import destroy_parallel, train_steps
from mindspeed_like.testing.parity import SEED

# the demo's CPU size (mindspeed_like/demo.py): its bf16 step is one of issue 49's targets
DEFAULT_SIZE = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=1024)


def arms(level: int) -> tuple[tuple[str, int, bool, bool], ...]:
    """(name, optimization level, bf16, upcast_cpu_gemm) of every arm, the features at ``level``."""
    return (
        ("megatron bf16", 0, True, False),
        ("megatron fp32", 0, False, False),
        ("megatron bf16 + upcast-cpu-gemm", 0, True, True),
        (f"level {level} bf16 without upcast-cpu-gemm", level, True, False),
        (f"level {level} bf16", level, True, True),
        (f"level {level} fp32", level, False, True),
    )


def run_arm(arm: tuple[str, int, bool, bool], size: dict, micro: int, steps: int) -> dict:
    """One arm in this process: build, one untimed round, one timed round."""
    _name, level, bf16, upcast = arm
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu", optimization_level=level, upcast_cpu_gemm=upcast)
    spec = dict(preset="llama", size=size, bf16=bf16, sp=False, seed=SEED, tp=1, ep=1)
    model = _build_model(spec, grouped_gemm_on=level > 0)
    stamps: list[float] = []
    train = dict(micro_batch_size=micro, seq_length=size["seq_length"], bf16=bf16)
    train_steps(model, 2, **train)  # untimed: compiles, first allocations
    losses = train_steps(model, steps + 1, on_step=lambda step, loss: stamps.append(time.perf_counter()), **train)
    result = {
        "step_times": [b - a for a, b in zip(stamps, stamps[1:])],
        "loss": losses[-1],
        "override_installed": host_gemm.installed(),
        "probe": host_gemm.probe().describe(),
    }
    destroy_parallel()
    mindspeed_like.reset()
    return result


def main() -> None:
    p = common.parser(
        __doc__.splitlines()[0],
        devices=("cpu",),
        why="upcast-cpu-gemm acts on a CPU's GEMMs; an accelerator's GEMMs are the device's own",
    )
    common.add_model_size_options(p, DEFAULT_SIZE)
    p.add_argument("--steps", type=common.positive_int, default=3, help="timed steps per process")
    p.add_argument("--level", type=int, choices=(1, 2), default=2, help="the features arms' optimization level")
    p.add_argument("--arm", type=int, help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.set_defaults(repeats=1)
    args = p.parse_args()
    micro = 1
    if args.arm is not None:  # a worker: one arm, printed for the parent
        common.to_parent(run_arm(arms(args.level)[args.arm], json.loads(args.size), micro, args.steps))
        return
    chosen = arms(args.level)
    fp32_of = {0: "megatron fp32", args.level: f"level {args.level} fp32"}
    size = common.model_size(args, DEFAULT_SIZE)
    host_gemm.pin_decision()  # one probe's decision for every arm (a loaded host cannot flip it per process)
    runs: list[dict] = [{"step_times": [], "losses": [], "installed": set()} for _ in chosen]
    for _ in range(args.repeats):
        for index, (name, *_rest) in enumerate(chosen):
            arm_args = ["--arm", str(index), "--level", str(args.level), "--steps", str(args.steps)]
            arm_args += ["--size", json.dumps(size)]
            out = common.in_fresh_process(__file__, arm_args, f"arm {name}")
            runs[index]["step_times"] += out["step_times"]
            runs[index]["losses"].append(out["loss"])
            runs[index]["installed"].add(out["override_installed"])
            print(f"{name}: median step {statistics.median(out['step_times']):.3f} s ({out['probe']})", flush=True)
    step = {name: statistics.median(run["step_times"]) for (name, *_), run in zip(chosen, runs)}
    results = common.Results("upcast-cpu-gemm")
    for (name, level, _bf16, _upcast), run in zip(chosen, runs):
        common.add_samples(name, run["step_times"])
        results.add(
            arm=name,
            tokens_per_s=round(micro * size["seq_length"] / step[name], 1),
            ratio_vs_megatron=round(step["megatron bf16"] / step[name], 3),
            step_vs_fp32=round(step[name] / step[fp32_of[level]], 3),
            override=" ".join(sorted("installed" if i else "not installed" for i in run["installed"])),
            loss=round(statistics.median(run["losses"]), 4),
            steps_timed=len(run["step_times"]),
        )
    results.print_table()
    probe = host_gemm.probe().describe()
    results.write_json(args.json, size=size, micro_batch_size=micro, level=args.level, probe=probe)


if __name__ == "__main__":
    main()
