"""Where a compare arm's step time goes: torch.profiler over its last steps, opt-in.

``MINDSPEED_LIKE_PROFILE=DIR`` makes every compare arm profile its last two training steps (CPU
and, on an accelerator, device activity) and write ``DIR/<arm>[-r<repeat>]-rank<rank>.txt``: the
operators sorted by their own device time (CPU time on a host), the top 40, and the wall time of
the profiled steps. Off by default: the profiler's own overhead would change the figures a record
keeps, so a profiled run is for reading, never for a record.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

ENV = "MINDSPEED_LIKE_PROFILE"
PROFILED_STEPS = 2
ROWS = 40


class StepProfiler:
    """Started after step ``steps - PROFILED_STEPS - 1`` ends, stopped after the last step."""

    def __init__(self, label: str, steps: int, device: str, rank: int) -> None:
        folder = os.environ.get(ENV)
        self.path = Path(folder) / f"{label}-rank{rank}.txt" if folder else None
        self.first = max(0, steps - PROFILED_STEPS)
        self.last = steps - 1
        self.device = device
        self._profiler: torch.profiler.profile | None = None
        if self.path is not None and self.first == 0:
            self._start()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()

    def after_step(self, step: int) -> None:
        if self.path is None:
            return
        if step == self.first - 1 and self._profiler is None:
            self._start()
        elif step == self.last and self._profiler is not None:
            if self.device == "cuda":
                torch.cuda.synchronize()
            self._profiler.__exit__(None, None, None)
            self._write()
            self._profiler = None

    def _write(self) -> None:
        assert self._profiler is not None and self.path is not None
        sort = "self_cuda_time_total" if self.device == "cuda" else "self_cpu_time_total"
        table = self._profiler.key_averages().table(sort_by=sort, row_limit=ROWS, max_name_column_width=60)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        steps = self.last - self.first + 1
        self.path.write_text(f"# the last {steps} step(s), sorted by {sort}\n{table}\n")
