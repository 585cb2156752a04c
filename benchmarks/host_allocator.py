"""host-allocator: megatron's own path (``--optimization-level 0``) and level 1, each with glibc
malloc as it is and with ``--tune-host-allocator``, in the same run: training tokens/s, minor page
faults and system seconds per step, and each arm's peak resident memory.

Each arm runs in a FRESH PROCESS (this script with ``--arm``): glibc's untouched allocator adapts
its mmap threshold as a process runs, and no setting made in a process can give that back
(features/host_allocator/glibc.py), so an untuned arm must never share a process with a tuned
one. The processes alternate over the repeats (arm 1, 2, 3, 4, arm 1, 2, ...) so machine noise
hits all alike. In each: the preset's model (compare/worker.py ``_build_model``, bf16, the same
weights in every arm, megatron's TE spec on the te-backend as in benchmarks/moe.py), one untimed
round (torch.compile of megatron's jit_fuser functions, ON unless TORCHDYNAMO_DISABLE is set; the
heap's first growth), then one round whose first step (optimizer build) is untimed and whose
next ``--steps`` steps are timed. Peak resident memory: the process's high-water mark (VmHWM,
one model and its optimizer) over the timed round, reset through ``/proc/self/clear_refs``.

    python benchmarks/host_allocator.py [--quick] [--repeats N] [--steps N] [--presets llama moe]
        [--num-layers L] [--hidden-size H] [--num-attention-heads N] [--seq-length S] [--record NAME]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import common  # benchmarks/ is the script directory (as in moe.py)

import mindspeed_like
from mindspeed_like.compare.worker import _build_model
from mindspeed_like.features import host_allocator
from mindspeed_like.testing import destroy_parallel, train_steps
from mindspeed_like.testing.parity import SEED

DEFAULT_SIZE = dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=1024)

ARMS = (  # name, optimization level, tune_host_allocator
    ("megatron", 0, False),
    ("megatron + host-allocator", 0, True),
    ("level 1 without host-allocator", 1, False),
    ("level 1", 1, True),
)


def _peak_rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class Arm:
    def __init__(self, name: str, level: int, tuned: bool, preset: str, size: dict, micro: int) -> None:
        self.name, self.level, self.tuned, self.micro, self.seq = name, level, tuned, micro, size["seq_length"]
        self.configure()
        spec = dict(preset=preset, size=size, bf16=True, sp=False, seed=SEED, tp=1, ep=1)
        self.model = _build_model(dict(spec, transformer_impl="transformer_engine"), grouped_gemm_on=level > 0)
        self.step_times: list[float] = []
        self.faults: list[float] = []
        self.system: list[float] = []
        self.peaks: list[int] = []

    def configure(self) -> None:
        mindspeed_like.reset()
        mindspeed_like.configure(device="cpu", optimization_level=self.level, tune_host_allocator=self.tuned)
        if host_allocator.tuned() != self.tuned:
            raise RuntimeError(f"{self.name}: the host allocator is not in the state this arm measures")

    def round(self, steps: int, timed: bool = True) -> None:
        self.configure()
        stamps: list[tuple[float, resource.struct_rusage]] = []

        def on_step(step: int, _loss: float) -> None:
            stamps.append((time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)))

        _peak_rss_reset()
        train_steps(self.model, steps + 1, micro_batch_size=self.micro, seq_length=self.seq, on_step=on_step)
        if not timed:
            return
        self.peaks.append(_peak_rss_bytes())
        for (t0, u0), (t1, u1) in zip(stamps, stamps[1:]):  # step 0 (optimizer build) untimed
            self.step_times.append(t1 - t0)
            self.faults.append(u1.ru_minflt - u0.ru_minflt)
            self.system.append(u1.ru_stime - u0.ru_stime)


def run_arm(index: int, preset: str, size: dict, micro: int, steps: int) -> dict:
    """One arm in this process: build, one untimed round, one timed round."""
    name, level, tuned = ARMS[index]
    arm = Arm(name, level, tuned, preset, size, micro)
    arm.round(1, timed=False)
    arm.round(steps)
    destroy_parallel()
    mindspeed_like.reset()
    return {"step_times": arm.step_times, "faults": arm.faults, "system": arm.system, "peaks": arm.peaks}


def spawn_arm(index: int, preset: str, size: dict, micro: int, steps: int) -> dict:
    args = ["--arm", str(index), "--preset", preset, "--steps", str(steps), "--size", json.dumps(size)]
    return common.in_fresh_process(__file__, args, f"arm {ARMS[index][0]} ({preset})")


def main() -> None:
    p = common.parser(
        __doc__.splitlines()[0],
        devices=("cpu",),
        why=(
            "host-allocator tunes glibc's malloc of a CPU host; on an accelerator the device's caching "
            "allocator holds the tensors (the feature says so and stays off)"
        ),
    )
    p.add_argument("--presets", nargs="+", choices=("llama", "moe", "qwen3-moe", "deepseek"), default=["llama", "moe"])
    common.add_model_size_options(p, DEFAULT_SIZE)
    p.add_argument("--steps", type=common.positive_int, default=3, help="timed steps per process")
    p.add_argument("--arm", type=int, help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.set_defaults(repeats=2)
    args = p.parse_args()
    micro = 2
    if args.arm is not None:  # a worker: one arm, printed for the parent
        common.to_parent(run_arm(args.arm, args.preset, json.loads(args.size), micro, args.steps))
        return
    size = common.model_size(args, DEFAULT_SIZE)
    results = common.Results("host-allocator")
    for preset in args.presets:
        runs: list[dict[str, list]] = [{"step_times": [], "faults": [], "system": [], "peaks": []} for _ in ARMS]
        for _ in range(args.repeats):
            for index in range(len(ARMS)):
                for key, values in spawn_arm(index, preset, size, micro, args.steps).items():
                    runs[index][key] += values
        base = statistics.median(runs[0]["step_times"])
        for (name, _, _), run in zip(ARMS, runs):
            step = statistics.median(run["step_times"])
            common.add_samples(name, run["step_times"])
            results.add(
                preset=preset,
                arm=name,
                tokens_per_s=round(micro * size["seq_length"] / step, 1),
                ratio_vs_megatron=round(base / step, 3),
                page_faults_per_step=round(statistics.median(run["faults"])),
                system_s_per_step=round(statistics.median(run["system"]), 3),
                peak_rss_mib=round(max(run["peaks"]) / 2**20),
                steps_timed=len(run["step_times"]),
            )
            print(f"{preset} {name}: {results.rows[-1]['tokens_per_s']} tokens/s", flush=True)
    results.print_table()
    results.write_json(args.json, size=size, micro_batch_size=micro)


if __name__ == "__main__":
    main()
