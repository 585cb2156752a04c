"""``make test-megatron-unit``: one pytest session per directory, then one record for the level.

One session over every directory kept ~2,000 tests' worth of state in one process; the pieces are
each short, print their own progress and record, and are merged into
results/megatron-unit-<level>.json (``record.merge``). Two names are sets rather than folders:
``optimizer`` is ``test_optimizer*.py`` plus ``optimizer/``, and ``transformer`` leaves out
``transformer/moe`` when that is its own piece.

    python -m mindspeed_like.testing.megatron_unit.run --level 0 --record results/megatron-unit-0.json \
        [--ranks 2,4] [--dirs fusions tensor_parallel ...] [-- extra pytest arguments]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from mindspeed_like.testing.megatron_unit import checkout
from mindspeed_like.testing.megatron_unit.record import merge

DIRS = [
    "fusions",
    "tensor_parallel",
    "pipeline_parallel",
    "models",
    "optimizer",
    "transformer",
    "transformer/moe",
    "dist_checkpointing",
]
CI_DIRS = ["fusions", "tensor_parallel", "models/test_gpt_model.py"]


def piece_args(unit: Path, piece: str, pieces: list[str]) -> list[str]:
    """The pytest paths of one piece (``optimizer`` and ``transformer`` as the module docstring says)."""
    if piece == "optimizer":
        return [*map(str, sorted(unit.glob("test_optimizer*.py"))), str(unit / "optimizer")]
    if piece == "transformer" and "transformer/moe" in pieces:
        return [str(unit / "transformer"), f"--ignore={unit / 'transformer' / 'moe'}"]
    return [str(unit / piece)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_like.testing.megatron_unit.run")
    parser.add_argument("--level", type=int, default=0)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--dirs", nargs="+", default=DIRS)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--pieces-dir", type=Path, default=Path("build/megatron-unit"))
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    try:
        found = checkout.check(checkout.find_root([]))
    except checkout.CheckoutError as error:
        print(f"megatron-unit: {error}", file=sys.stderr)
        return 2
    args.pieces_dir.mkdir(parents=True, exist_ok=True)
    parts, failed = [], False
    for piece in args.dirs:
        part = args.pieces_dir / f"L{args.level}-{piece.replace('/', '-').replace('.py', '')}.json"
        # its own basetemp: megatron's tmp_path_dist_ckpt (the basetemp's grandparent / "tmp_dist_ckpt")
        # is then this piece's, not shared with a run of another level beside it
        piece_tmp = (args.pieces_dir / "tmp" / part.stem).resolve()
        piece_tmp.mkdir(parents=True, exist_ok=True)
        # `--option=value` in one token: pytest finds its rootdir before it knows the plugin's options,
        # and a separate value naming an existing file (a record of an earlier run) moved the rootdir
        cmd = [
            sys.executable, "-m", "pytest", "-p", "mindspeed_like.testing.megatron_unit_tests",
            "-p", "no:cacheprovider", "-o", "addopts=", "-q", "-W", "ignore", "-rN", f"--rootdir={found.root}",
            f"--megatron-level={args.level}", f"--megatron-ranks={args.ranks}", f"--megatron-record={part}",
            f"--basetemp={piece_tmp / 'basetemp'}",
            *args.pytest_args, *piece_args(found.unit_tests, piece, args.dirs),
        ]  # fmt: skip
        started = time.monotonic()
        print(f"== megatron-unit L{args.level} {piece}", flush=True)
        done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        print(f"== megatron-unit L{args.level} {piece}: exit {done.returncode}, {time.monotonic() - started:.0f} s")
        failed |= done.returncode not in (0, 1)  # 1: some tests failed (recorded); else the session broke
        if part.exists():
            parts.append(part)
    if parts:
        command = [
            "python",
            "-m",
            "mindspeed_like.testing.megatron_unit.run",
            *(argv if argv is not None else sys.argv[1:]),
        ]
        print(merge(args.record, parts, level=args.level, command=command))
    return 1 if failed or not parts else 0


if __name__ == "__main__":
    raise SystemExit(main())
