"""What a CUDA rank held at its peak: the caching allocator's history, recorded in a compare arm and
replayed to its highest point.

``MINDSPEED_LIKE_MEMORY_HISTORY=DIR`` makes every compare arm on CUDA record the allocator's history
(``torch.cuda.memory._record_memory_history``, Python stacks) from before the model reaches the
device to the arm's end, and write ``DIR/<arm>[-r<repeat>]-rank<rank>.pickle`` (torch's snapshot
format; pytorch.org/memory_viz reads it too). Off by default: recording costs time, so a recorded run
is for reading, never for a record. Then, anywhere (no GPU needed)::

    python -m mindspeed_like.toolkit.allocator_history DIR/features-rank0.pickle [--top 25]

replays every allocation and completed free of the device's trace, finds the highest total (what
``torch.cuda.max_memory_allocated`` reports) and lists the blocks alive there, grouped by the first
frames of megatron's or this library's code that allocated them. This is how the plan's device
rows were found (docs/plan.md, "On a GPU"): torch's fused RMSNorm on CUDA, megatron's score buffer,
the cuBLAS workspaces, and compare's probe holding a step's activations through its backward.
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV = "MINDSPEED_LIKE_MEMORY_HISTORY"
MAX_ENTRIES = 1_000_000  # events kept (a ring): a 4-layer compare arm of 4 steps has ~6,000
OURS = ("megatron", "mindspeed_like", "pretrain_gpt")


@dataclass
class Peak:
    """The highest total of live blocks in a trace, and those blocks."""

    bytes: int
    event: int
    events: int
    allocating: str  # where the allocation that reached the peak came from
    live: list[dict[str, Any]] = field(default_factory=list)  # the trace's alloc events alive then

    def groups(self, frames: int = 2) -> list[tuple[str, int, int]]:
        """(where, bytes, blocks) of the live blocks by their first ``frames`` frames of megatron's
        or this library's code, largest first."""
        sizes: collections.Counter[str] = collections.Counter()
        counts: collections.Counter[str] = collections.Counter()
        for event in self.live:
            key = where(event.get("frames") or [], frames)
            sizes[key] += event["size"]
            counts[key] += 1
        return [(key, size, counts[key]) for key, size in sizes.most_common()]


def where(frames: Sequence[dict[str, Any]], depth: int = 2) -> str:
    """``file:line:function`` of the first ``depth`` frames in megatron's or this library's code
    (the first frame of any code where none is; empty for an allocation C++ made with no Python
    caller, e.g. autograd's backward)."""
    ours = [f for f in frames if any(name in f["filename"] for name in OURS)]
    chosen = ours[:depth] if ours else list(frames[:1])
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in chosen)


def peak_of(snapshot: dict[str, Any], device: int = 0) -> Peak:
    """Replay ``device``'s trace of a snapshot (``torch.cuda.memory._snapshot()``'s dict) to its peak.
    A block counts from its ``alloc`` to its ``free_completed`` (a free requested on another stream's
    behalf is still held until then, as the allocator counts it)."""
    trace = snapshot["device_traces"][device]
    live: dict[int, tuple[int, dict[str, Any]]] = {}
    total = best = best_at = 0
    best_live: list[dict[str, Any]] = []
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = (i, event)
            total += event["size"]
            if total > best:
                best, best_at = total, i
                best_live = [e for _, e in sorted(live.values(), key=lambda pair: pair[0])]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[1]["size"]
    allocating = where(trace[best_at].get("frames") or [], 3) if trace else ""
    return Peak(best, best_at, len(trace), allocating, best_live)


def start(device: str) -> bool:
    """Start recording the allocator's history when ``$MINDSPEED_LIKE_MEMORY_HISTORY`` is set and
    ``device`` is CUDA; returns whether it started."""
    if not os.environ.get(ENV) or device != "cuda":
        return False
    import torch

    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    return True


def dump(label: str, rank: int) -> Path:
    """Write the recorded history to ``$MINDSPEED_LIKE_MEMORY_HISTORY/<label>-rank<rank>.pickle``
    and stop recording."""
    import torch

    path = Path(os.environ[ENV]) / f"{label}-rank{rank}.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)
    return path


def report(peak: Peak, top: int = 25) -> list[str]:
    lines = [
        f"peak {peak.bytes / 2**20:,.1f} MiB at event {peak.event} of {peak.events}; "
        f"allocating: {peak.allocating or '(no Python caller)'}"
    ]
    for key, size, count in peak.groups()[:top]:
        lines.append(f"  {size / 2**20:10,.1f} MiB  x{count:<5d} {key or '(no Python caller: C++, e.g. backward)'}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mindspeed_like.toolkit.allocator_history",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("snapshots", nargs="+", type=Path, help="pickles written under $" + ENV)
    parser.add_argument("--top", type=int, default=25, help="groups to list (default 25)")
    args = parser.parse_args(argv)
    for path in args.snapshots:
        if not path.is_file():
            parser.error(f"{path}: no such file (a snapshot written under ${ENV})")
        with path.open("rb") as handle:
            snapshot = pickle.load(handle)
        if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
            parser.error(f"{path}: not a CUDA allocator snapshot (torch.cuda.memory._dump_snapshot's format)")
        print(f"== {path}")
        print(*report(peak_of(snapshot), args.top), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
