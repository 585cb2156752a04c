"""Record when the tiled tensor-parallel kernels issue and wait collectives and run matmuls.

    with record_timeline() as events:
        layer(x)
    # events: [("issue", "all_gather", 0), ("issue", "all_gather", 1), ("wait", "all_gather", 0),
    #          ("mm_start", 0), ("mm_end", 0), ("wait", "all_gather", 1), ...]

Collectives are numbered per kind in issue order and matmuls in call order, which is tile
order in every schedule (``mindspeed_like.kernels.tp_overlap.schedules``). The recorder
replaces the four functions of ``mindspeed_like.kernels.tp_overlap.ops`` for the block.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from mindspeed_like.kernels.tp_overlap import ops


class _RecordedWork:
    def __init__(self, work, events: list, kind: str, index: int) -> None:
        self._work, self._events, self._kind, self._index = work, events, kind, index

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._events.append(("wait", self._kind, self._index))
        return result


@contextlib.contextmanager
def record_timeline() -> Iterator[list]:
    events: list = []
    counts: Counter = Counter()
    originals = {name: getattr(ops, name) for name in ("matmul", "all_gather", "reduce_scatter", "all_reduce")}

    def collective(kind: str):
        original = originals[kind]

        def call(*args, **kwargs):
            index = counts[kind]
            counts[kind] += 1
            work = original(*args, **kwargs)
            events.append(("issue", kind, index))
            return _RecordedWork(work, events, kind, index)

        return call

    def matmul(a, b):
        index = counts["matmul"]
        counts["matmul"] += 1
        events.append(("mm_start", index))
        result = originals["matmul"](a, b)
        events.append(("mm_end", index))
        return result

    replacements = {name: collective(name) for name in ("all_gather", "reduce_scatter", "all_reduce")}
    replacements["matmul"] = matmul
    for name, fn in replacements.items():
        setattr(ops, name, fn)
    try:
        yield events
    finally:
        for name, fn in originals.items():
            setattr(ops, name, fn)


def position(events: list, event: tuple) -> int:
    """Index of ``event`` in ``events`` (a clear error when it never happened)."""
    try:
        return events.index(event)
    except ValueError:
        raise AssertionError(f"{event} not in the timeline {events}") from None
