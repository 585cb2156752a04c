"""The run's record, results/megatron-unit-<level>.json: per directory and per test the outcome,
the world size it ran at and, for every test that did not pass, one reason class.

Written with the project's record format (``mindspeed_like.toolkit.records``: command, versions,
host, load average at start), so docs/megatron-tests.md renders its tables from it
(``make docs``) and ``tests/docs/test_doc_tables.py`` catches a hand edit. Rows: one per test
(``table: tests``) and one per directory (``table: dirs``); ``extra`` holds the totals, the
classes' counts, the wall time of the whole run and of each world size's launches.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

from mindspeed_like.testing.megatron_unit.reasons import classify_failure, classify_skip, what_it_would_take
from mindspeed_like.toolkit.records import Record


def directory_of(nodeid: str) -> str:
    """``tests/unit_tests/transformer/moe/test_x.py::T::t`` -> ``transformer/moe``; top-level files: their name."""
    path = nodeid.split("::")[0]
    if "unit_tests/" in path:
        path = path.split("unit_tests/", 1)[1]
    parts = path.split("/")
    if len(parts) == 1:
        return parts[0].removesuffix(".py")
    return "/".join(parts[:-1])


class Outcomes:
    """Each test's final outcome as the plugin settles it (a relaunched test's last word counts)."""

    def __init__(self) -> None:
        self.tests: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()
        self.size_wall_s: dict[int, float] = {}

    def settle(self, nodeid: str, outcome: str, world_size: int, cls: str | None, reason: str = "") -> None:
        self.tests[nodeid] = {
            "dir": directory_of(nodeid),
            "test": nodeid,
            "outcome": outcome,
            "world_size": world_size,
            "class": cls if outcome != "passed" else None,
            "reason": reason[:500] if outcome != "passed" else "",
        }

    def per_directory(self) -> dict[str, Counter]:
        out: dict[str, Counter] = {}
        for row in self.tests.values():
            out.setdefault(row["dir"], Counter())[row["outcome"]] += 1
        return out

    def summary_line(self, directory: str) -> str:
        counts = self.per_directory().get(directory, Counter())
        total = sum(counts.values())
        return f"{directory}: {total} tests, " + ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped"))


def _percent(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 1) if whole else 0.0


def write(outcomes: Outcomes, path: Path, *, level: int, options: dict[str, Any], command: list[str]) -> Path:
    """The record at ``path`` (totals, per directory, per test, classes, wall times)."""
    record = Record(path.stem, command=command)
    record.options = {"level": level, **options}
    rows = sorted(outcomes.tests.values(), key=lambda r: r["test"])
    per_dir = outcomes.per_directory()
    for directory in sorted(per_dir):
        counts = per_dir[directory]
        total = sum(counts.values())
        classes = Counter(r["class"] for r in rows if r["dir"] == directory and r["outcome"] != "passed")
        record.add_row(
            table="dirs",
            dir=directory,
            collected=total,
            passed=counts["passed"],
            failed=counts["failed"],
            skipped=counts["skipped"],
            passed_pct=_percent(counts["passed"], total),
            classes=dict(classes.most_common()),
        )
    for row in rows:
        record.add_row(table="tests", **row)
    totals = Counter(r["outcome"] for r in rows)
    record.extra = {
        "level": level,
        "collected": len(rows),
        "passed": totals["passed"],
        "failed": totals["failed"],
        "skipped": totals["skipped"],
        "passed_pct": _percent(totals["passed"], len(rows)),
        "failure_classes": dict(Counter(r["class"] for r in rows if r["outcome"] == "failed").most_common()),
        "skip_classes": dict(Counter(r["class"] for r in rows if r["outcome"] == "skipped").most_common()),
        "world_sizes": dict(Counter(str(r["world_size"]) for r in rows)),
        "what_it_would_take": {
            cls: what_it_would_take(cls) for cls in sorted({r["class"] for r in rows if r["outcome"] != "passed"})
        },
        "wall_s": round(time.monotonic() - outcomes.started, 1),
        "wall_s_per_world_size": {str(k): round(v, 1) for k, v in sorted(outcomes.size_wall_s.items())},
    }
    return record.write(path)


def merge(
    out: Path, parts: list[Path], *, level: int, command: list[str] | None = None, reclassify: bool = False
) -> Path:
    """One level's record from the records of its pieces (directories run one pytest at a time, so
    the host is never loaded by one long session): tests and classes as the pieces recorded them (a
    later part's outcome of a test wins), the wall time the sum of the pieces', each piece's command
    kept in ``options.pieces``, the launch sizes the union of the parts'."""
    import json

    outcomes = Outcomes()
    wall = 0.0
    pieces: list[dict[str, Any]] = []
    ranks: set[int] = set()
    for part in parts:
        data = json.loads(Path(part).read_text())
        for row in data["rows"]:
            if row.get("table") == "tests":
                cls = row["class"]
                if reclassify and row["outcome"] == "failed":  # the rules as they are now, on the kept text
                    cls = classify_failure(row["reason"], row["test"], row["world_size"]) if cls != "timeout" else cls
                    cls = row["class"] if cls == "unknown" else cls
                if (
                    reclassify
                    and row["outcome"] == "skipped"
                    and (str(cls).startswith("harness") or cls == "missing-package")
                ):
                    # the harness' own skips, read as their reason says; missing-package's rule was refined
                    # (a config skip saying "requires" is megatron's own)
                    cls = classify_skip(row["reason"])
                outcomes.settle(row["test"], row["outcome"], row["world_size"], cls, row["reason"])
        wall += data["extra"]["wall_s"]
        for size, seconds in data["extra"].get("wall_s_per_world_size", {}).items():
            outcomes.size_wall_s[int(size)] = outcomes.size_wall_s.get(int(size), 0.0) + seconds
        ranks.update(data["options"].get("ranks", []))
        # a merged record as a part (a level's record with more pieces over it): its own pieces, flat
        pieces.extend(
            data["options"].get("pieces")
            or [{"command": data["command"], "started_at": data["started_at"], "wall_s": data["extra"]["wall_s"]}]
        )
    options = dict(json.loads(Path(parts[0]).read_text())["options"]) if parts else {}
    options.pop("level", None)
    options["ranks"] = sorted(ranks)
    options["pieces"] = pieces
    options["failures_reclassified_from_kept_reason"] = reclassify
    path = write(
        outcomes, out, level=level, options=options, command=command or ["make", "test-megatron-unit", f"LEVEL={level}"]
    )
    data = json.loads(path.read_text())
    data["extra"]["wall_s"] = round(wall, 1)
    data["started_at"] = min(p["started_at"] for p in pieces) if pieces else data["started_at"]
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m mindspeed_like.testing.megatron_unit.record merge --level N OUT PIECE...``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mindspeed_like.testing.megatron_unit.record")
    sub = parser.add_subparsers(dest="command", required=True)
    merging = sub.add_parser("merge", help="one level's record from its pieces' records")
    merging.add_argument("--level", type=int, required=True)
    merging.add_argument("out", type=Path)
    merging.add_argument("parts", type=Path, nargs="+")
    merging.add_argument("--command", default=None, help="the command that ran the pieces (the record's command)")
    merging.add_argument(
        "--reclassify", action="store_true", help="re-read failures' classes from their kept reason (rules refined)"
    )
    args = parser.parse_args(argv)
    command = args.command.split() if args.command else None
    print(merge(args.out, args.parts, level=args.level, command=command, reclassify=args.reclassify))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
