"""Accelerations under megatron's FSDP paths (issue 54 items 5 and 6): `mindspeed-like compare` with
both arms under the same data-parallel wrapper, at the same size, in one run of this script:

* speed: each path's level-N speedup over megatron's own path (tokens/s, the median of the
  alternating repeats' ratios) divided by the same preset's speedup under the distributed
  optimizer, the path every other record uses (issue 54's target: >= 0.9);
* memory: each path's per-rank weights, gradients and optimizer state (compare's meter: every
  storage reached from the live model and optimizer, this rank's shards) at two data-parallel
  sizes, and their ratio (sharded state falls as 1/DP; what does not is named in
  docs/features/fsdp.md).

Every compare run writes its own record too (results/compare-<preset>-dp<N>-...json).

    python benchmarks/fsdp.py [--quick] [--preset llama] [--level 1] [--repeats 3] [--steps 8]
        [--memory-dp 2 4] [--record NAME]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import common  # benchmarks/ is the script directory (as in te_backend.py)

from mindspeed_like.cli import main as cli

PATHS = {
    "distopt": ["--use-distributed-optimizer"],
    "torch_fsdp2": ["--use-torch-fsdp2"],
    "megatron_fsdp": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
}
KINDS = ("weights", "gradients", "optimizer", "model_state")
SPEEDUP_TARGET = 0.9
SIZE = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256)  # compare's defaults


def _compare(args: argparse.Namespace, path: str, dp: int, *, timed: bool) -> dict[str, Any]:
    size = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size)]
    size += ["--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length)]
    runs = ["--repeats", str(args.repeats), "--steps", str(args.steps)] if timed else ["--repeats", "1", "--steps", "3"]
    with tempfile.TemporaryDirectory() as out:
        line = ["compare", "--preset", args.preset, "--data-parallel-size", str(dp), *PATHS[path], *size, *runs]
        line += ["--optimization-level", str(args.level), "--quiet", "--out", out]
        if timed:
            line += ["--record"]
        print("== mindspeed-like " + " ".join(line), flush=True)
        if cli(line) != 0:
            raise SystemExit(f"compare failed: {' '.join(line)}")
        return json.loads((Path(out) / "compare.json").read_text())["compare"]


def main() -> None:
    p = common.parser(__doc__.split("\n\n")[0], devices=("cpu",), why="the CPU records (gloo ranks on one host)")
    p.set_defaults(repeats=3)
    p.add_argument("--preset", default="llama", help="a compare preset without tied embeddings (FSDP2 refuses those)")
    p.add_argument("--level", type=int, default=1, help="the optimization level of the features arm (default 1)")
    p.add_argument("--steps", type=common.positive_int, default=8)
    p.add_argument("--memory-dp", type=common.positive_int, nargs=2, default=[2, 4], metavar=("SMALL", "LARGE"))
    common.add_model_size_options(p, SIZE)
    args = p.parse_args()
    args.__dict__.update(common.model_size(args, SIZE))
    if args.quick:
        args.repeats, args.steps = 1, 4
    small, large = args.memory_dp
    speed, versus_distopt = common.Results("speed"), common.Results("speedup_vs_distopt")
    state = common.Results("memory")
    speedups: dict[str, float] = {}
    memory: dict[str, dict[int, dict[str, int]]] = {}
    for path in PATHS:
        result = _compare(args, path, small, timed=True)
        speedups[path] = result["ratios"]["tokens_per_s"]
        memory[path] = {small: result["megatron"]["memory_per_rank"]}
        speed.add(
            path=path,
            data_parallel_size=small,
            level=args.level,
            tokens_per_s_megatron=result["megatron"]["tokens_per_s"],
            tokens_per_s_features=result["with_features"]["tokens_per_s"],
            speedup=speedups[path],
            speedup_spread=result["ratio_spread"]["tokens_per_s"],
            max_loss_diff=result["loss"]["max_abs_diff"],
            fell_back=sorted(result["features"]["fell_back"]),
        )
    for path in ("torch_fsdp2", "megatron_fsdp"):
        memory[path][large] = _compare(args, path, large, timed=False)["megatron"]["memory_per_rank"]
    print(f"\nlevel {args.level} over megatron's own path, tokens/s (dp={small}, {args.preset})")
    print(f"{'path':16} {'speedup':>8} {'vs distopt':>11}  target >= {SPEEDUP_TARGET}")
    for path, speedup in speedups.items():
        versus = speedup / speedups["distopt"]
        met = "" if path == "distopt" else ("met" if versus >= SPEEDUP_TARGET else "NOT met")
        print(f"{path:16} {speedup:8.2f}x {versus:10.2f}x  {met}")
        versus_distopt.add(path=path, ratio=versus, target=SPEEDUP_TARGET)
    print(f"\nmegatron's arm, per-rank bytes at dp={small} and dp={large} (ratio; 1/DP = {small / large:.2f})")
    for path in ("torch_fsdp2", "megatron_fsdp"):
        for kind in KINDS:
            a, b = memory[path][small][kind], memory[path][large][kind]
            print(f"{path:16} {kind:12} {a:>12,} {b:>12,}  {b / a:5.2f}")
            state.add(path=path, kind=kind, **{f"dp{small}": a, f"dp{large}": b, "ratio": b / a})
    common.write(args.json)


if __name__ == "__main__":
    main()
