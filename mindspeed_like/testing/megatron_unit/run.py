"""``make test-megatron-unit``: one pytest session per directory, then one record for the level.

One session over every directory kept ~2,000 tests' worth of state in one process; the pieces are
each short, print their own progress and record, and are merged into
results/megatron-unit-<level>.json (``record.merge``). Two names are sets rather than folders:
``optimizer`` is ``test_optimizer*.py`` plus ``optimizer/``, and ``transformer`` leaves out
``transformer/moe`` when that is its own piece.

    python -m mindspeed_like.testing.megatron_unit.run --level 0 --record results/megatron-unit-0.json \
        [--ranks 2,4] [--dirs fusions tensor_parallel ...] [-- extra pytest arguments]

With ``--rank-skips-of RECORD --ranks 2,4,8`` it runs only the tests RECORD set aside for more ranks
than RECORD's run allowed, straight under the largest size (no world-size-1 pass: they are known to
want ranks), in chunks of ``--chunk`` tests, and merges them over RECORD: the same outcomes as one
run allowing 8 from the start, without the ~1.5 hours of tests already settled. ``--resume`` keeps a
chunk whose record exists (a stopped run goes on where it stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mindspeed_like.testing.megatron_unit import checkout
from mindspeed_like.testing.megatron_unit.record import merge

RANK_SKIP_CLASS = "needs-more-ranks"

DIRS = [
    "fusions",
    "tensor_parallel",
    "pipeline_parallel",
    "models",
    "optimizer",
    "transformer",
    "transformer/moe",
    "dist_checkpointing",
    "distributed",
]
CI_DIRS = ["fusions", "tensor_parallel", "models/test_gpt_model.py"]


def piece_args(unit: Path, piece: str, pieces: list[str]) -> list[str]:
    """The pytest paths of one piece (``optimizer`` and ``transformer`` as the module docstring says)."""
    if piece == "optimizer":
        return [*map(str, sorted(unit.glob("test_optimizer*.py"))), str(unit / "optimizer")]
    if piece == "transformer" and "transformer/moe" in pieces:
        return [str(unit / "transformer"), f"--ignore={unit / 'transformer' / 'moe'}"]
    return [str(unit / piece)]


def passed_in_piece(root: Path, node_ids: list[str], piece: str, pieces: list[str]) -> list[str]:
    """The node ids (``tests/unit_tests/...`` under the checkout ``root``) that the piece's pytest
    paths (:func:`piece_args`: files or folders, and ``--ignore=`` folders) collect."""
    args = piece_args(root / "tests" / "unit_tests", piece, pieces)
    ignored = [Path(a.split("=", 1)[1]) for a in args if a.startswith("--ignore=")]
    included = [Path(a) for a in args if not a.startswith("--")]

    def inside(path: Path, folders: list[Path]) -> bool:
        return any(path == folder or folder in path.parents for folder in folders)

    return [
        node_id
        for node_id in node_ids
        if inside(root / node_id.split("::", 1)[0], included) and not inside(root / node_id.split("::", 1)[0], ignored)
    ]


def passed_tests(record: Path) -> set[str]:
    """The node ids ``record`` saw pass."""
    rows = json.loads(record.read_text())["rows"]
    return {r["test"] for r in rows if r.get("table") == "tests" and r["outcome"] == "passed"}


def rank_skips(
    record: Path, dirs: list[str] | None, chunk: int, only: set[str] | None = None
) -> list[tuple[str, list[str]]]:
    """The tests ``record`` set aside for more ranks, as (piece name, node ids) chunks per directory
    (only ``dirs`` when given; the record's directory names, e.g. ``transformer/moe``; only the node
    ids in ``only`` when given)."""
    rows = [r for r in json.loads(record.read_text())["rows"] if r.get("table") == "tests"]
    by_dir: dict[str, list[str]] = {}
    for row in rows:
        if (
            row["class"] == RANK_SKIP_CLASS
            and (not dirs or row["dir"] in dirs)
            and (only is None or row["test"] in only)
        ):
            by_dir.setdefault(row["dir"], []).append(row["test"])
    pieces = []
    for directory, nodeids in sorted(by_dir.items()):
        for start in range(0, len(nodeids), chunk):
            pieces.append((f"{directory}-{start // chunk + 1}", nodeids[start : start + chunk]))
    return pieces


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_like.testing.megatron_unit.run")
    parser.add_argument("--level", type=int, default=0)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--dirs", nargs="+", default=None, help=f"default: {' '.join(DIRS)}")
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--pieces-dir", type=Path, default=Path("build/megatron-unit"))
    parser.add_argument(
        "--rank-skips-of",
        type=Path,
        default=None,
        help="run only the tests this record set aside for more ranks, under the largest --ranks size, "
        "and merge them over it (--dirs then filters the record's directories)",
    )
    parser.add_argument(
        "--passed-in",
        type=Path,
        default=None,
        help="only the tests this record (level 0's) saw pass, of each piece (with --rank-skips-of: of the set-aside "
        "ones); at levels 1 and 2 those are the ones that can show a regression",
    )
    parser.add_argument("--chunk", type=int, default=40, help="tests per piece with --rank-skips-of")
    parser.add_argument("--resume", action="store_true", help="keep a piece whose record exists")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    if args.rank_skips_of is not None:
        if not args.rank_skips_of.exists():
            parser.error(f"--rank-skips-of {args.rank_skips_of}: no such record (run the level without it first)")
        recorded = json.loads(args.rank_skips_of.read_text()).get("options", {}).get("level")
        if recorded != args.level:
            parser.error(f"--rank-skips-of {args.rank_skips_of} is a level-{recorded} record; --level is {args.level}")
    if args.passed_in is not None and not args.passed_in.exists():
        parser.error(f"--passed-in {args.passed_in}: no such record")
    try:
        found = checkout.check(checkout.find_root([]))
    except checkout.CheckoutError as error:
        print(f"megatron-unit: {error}", file=sys.stderr)
        return 2
    args.pieces_dir.mkdir(parents=True, exist_ok=True)
    sizes = sorted(int(s) for s in args.ranks.split(",") if s.strip())
    if args.rank_skips_of is not None:
        planned = [
            (f"ws{sizes[-1]}-{name}", [f"--megatron-launch-size={sizes[-1]}", *(str(found.root / n) for n in ids)])
            for name, ids in rank_skips(
                args.rank_skips_of, args.dirs, args.chunk, passed_tests(args.passed_in) if args.passed_in else None
            )
        ]
        parts, failed = [args.rank_skips_of], False
    else:
        dirs = args.dirs or DIRS
        planned = [(piece, piece_args(found.unit_tests, piece, dirs)) for piece in dirs]
        if args.passed_in is not None:  # each piece's node ids that passed there, or nothing to run
            passed = sorted(passed_tests(args.passed_in))
            planned = [
                (piece, ids)
                for piece, _ in planned
                if (ids := [str(found.root / t) for t in passed_in_piece(found.root, passed, piece, dirs)])
            ]
        parts, failed = [], False
    for piece, paths in planned:
        part = args.pieces_dir / f"L{args.level}-{piece.replace('/', '-').replace('.py', '')}.json"
        if args.resume and part.exists():
            print(f"== megatron-unit L{args.level} {piece}: kept ({part})", flush=True)
            parts.append(part)
            continue
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
            *args.pytest_args, *paths,
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
