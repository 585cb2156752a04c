"""Measure the plan's CPU accuracy records again, in one batch: every ``compare-plan-*`` record in
results/ re-run by its own command (the calibration baselines first).

    python -m mindspeed_like.plan.measure_records            # all of them (~15 minutes on 2 cores)
    python -m mindspeed_like.plan.measure_records --only moe # the records whose name contains "moe"
    python -m mindspeed_like.plan.measure_records --list     # what would run
    python -m mindspeed_like.plan.measure_records --repeats 3 # each run repeated (medians kept)
    python -m mindspeed_like.plan.measure_records --steps 8 --into /tmp/r8
        # each run for 8 steps (compare's default) into another folder, results/ left as it is;
        # then MINDSPEED_LIKE_RESULTS=/tmp/r8 python -m mindspeed_like.plan.accuracy

Why one batch: a CPU process's resident set includes the runtime (Python, torch, megatron, this
library), which moves with the code, and the plan's CPU runtime term is read from the baseline
records; a table whose records and baselines came from different revisions measures that drift,
not the plan. Every run gets the conditions the table states: torch.compile off
(``TORCHDYNAMO_DISABLE=1``: compiled graphs change the process's resident set by what inductor
loads, which the eager baselines do not have) and one thread per process (``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mindspeed_like.plan.peak import BASELINE_RECORDS
from mindspeed_like.toolkit import records

PREFIX = "compare-plan-"
CONDITIONS = {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def plan_records(folder: Path | None = None) -> list[Path]:
    """The CPU compare records made for the plan's table, baselines first."""
    folder = folder or records.results_dir()
    found = [p for p in sorted(folder.glob(f"{PREFIX}*.json")) if not records.is_accelerator_record(p.stem)]
    baselines = set(BASELINE_RECORDS.values())
    return sorted(found, key=lambda p: (p.stem not in baselines, p.stem))


def command_of(path: Path, repeats: int | None = None, steps: int | None = None) -> list[str]:
    """The record's own compare command, writing the record under its own name (``repeats``,
    ``steps``: in place of the record's own counts; compare keeps the median of a rank's memory and
    step time)."""
    command = list(records.read(path)["command"])
    if command[:2] != ["mindspeed-like", "compare"]:
        raise ValueError(f"{path.name}: not a compare record (its command is {' '.join(command)!r})")
    given = {"--repeats": repeats, "--steps": steps}
    replaced = ("--record", *(option for option, value in given.items() if value is not None))
    for option in (o for o in replaced if o in command):
        at = command.index(option)
        del command[at : at + 2]
    for option, value in given.items():
        if value is not None:
            command += [option, str(value)]
    return [sys.executable, "-m", "mindspeed_like.cli", *command[1:], "--record", path.stem, "--quiet"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mindspeed_like.plan.measure_records",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--only", default="", help="only the records whose name contains this")
    parser.add_argument("--list", action="store_true", help="print the commands, run nothing")
    parser.add_argument(
        "--repeats", type=int, default=None, help="run each record this many times (default: as recorded)"
    )
    parser.add_argument("--steps", type=int, default=None, help="train each run this many steps (default: as recorded)")
    parser.add_argument(
        "--into",
        type=Path,
        default=None,
        help="write the records into this folder instead of results/ (the plan reads a folder's records, "
        "baselines included, with MINDSPEED_LIKE_RESULTS=FOLDER)",
    )
    args = parser.parse_args(argv)
    paths = [p for p in plan_records() if args.only in p.stem]
    if not paths:
        parser.error(f"no {PREFIX}* record in {records.results_dir()} matches {args.only!r}")
    env = {**os.environ, **CONDITIONS}
    if args.into is not None:
        args.into.mkdir(parents=True, exist_ok=True)
        env[records.RESULTS_ENV] = str(args.into.resolve())
    failed = []
    for path in paths:
        command = command_of(path, args.repeats, args.steps)
        print(f"{path.stem}: {' '.join(command[2:])}", flush=True)
        if args.list:
            continue
        start = time.monotonic()
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        summary = [line for line in done.stdout.splitlines() if line.startswith("summary:")]
        print(f"  {time.monotonic() - start:.0f} s, rc {done.returncode}: {summary[-1] if summary else ''}", flush=True)
        if done.returncode:
            print(done.stdout[-3000:], flush=True)
            failed.append(path.stem)
    if failed:
        print("FAILED:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
