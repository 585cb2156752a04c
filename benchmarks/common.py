"""The benchmark convention: every script prints a table and, with `--json PATH`, writes its
figures as JSON (one object: `benchmark`, `host`, `rows`). Ratios are always against
megatron's own path measured in the same run, never against numbers from another run."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.profiler import profile
from torch.profiler._memory_profiler import Action


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    p.add_argument("--json", metavar="PATH", help="also write the figures to this JSON file")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per case (the median is reported)")
    p.add_argument("--quick", action="store_true", help="smaller shapes, for a smoke run")
    return p


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak of (bytes created - bytes destroyed) while ``fn`` runs, from the profiler's memory
    timeline. Only tensors created inside ``fn`` count: freeing an older tensor (last step's
    gradients) must not lower the figure."""
    with profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    current = peak = 0
    created: set = set()
    for _, action, (key, _version), size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            created.add(key)
            current += size
        elif action == Action.DESTROY and key in created:
            created.discard(key)
            current -= size
        peak = max(peak, current)
    return peak


def host() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }


class Results:
    """Rows of one benchmark; printed as an aligned table, optionally saved as JSON."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rows: list[dict[str, Any]] = []

    def add(self, **row: Any) -> None:
        self.rows.append(row)

    def print_table(self, columns: Sequence[str] | None = None) -> None:
        columns = list(columns or (self.rows[0].keys() if self.rows else []))
        cells = [[_fmt(row.get(c, "")) for c in columns] for row in self.rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
        print(f"== {self.name} ==")
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
        for row in cells:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths)))

    def write_json(self, path: str | None, **extra: Any) -> None:
        if not path:
            return
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"benchmark": self.name, "host": host(), **extra, "rows": self.rows}, handle, indent=2)
        print(f"wrote {path}")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
