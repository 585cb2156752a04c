"""Measurement records: what every benchmark and compare run writes, so the numbers in the docs
are rendered from data (``make docs``) instead of typed by hand.

One record is one JSON object::

    {"schema": 1, "name": "te_backend", "command": [...], "started_at": "...", "finished_at": "...",
     "host": {"load_average_at_start": [1.1, 2.0, 2.5], "cpu_count": 2, "threads": 1, "device": "cpu", ...},
     "versions": {"python": ..., "torch": ..., "megatron_core": ..., "triton": ...,
                  "mindspeed_like": <git commit or version>},
     "options": {...}, "rows": [{...}, ...], "samples": {"<case>/<path>": [seconds, ...]}}

The load average is read when the record is *created* (the start of the run): a figure taken
while something else loaded the host says so in its own record.

A record measured on an accelerator names it: ``host.device`` is its type (``cuda``, ``npu``),
``host.device_name`` what the driver calls it (``torch.cuda.get_device_name()``, e.g. ``NVIDIA
H100 80GB HBM3``), ``host.device_count``, and ``host.cuda`` / ``host.cudnn`` the builds torch uses. Its
default name ends in the device type (:func:`device_record_name`: ``attention-cuda``), so the CPU
record and the GPU record of one benchmark live side by side in results/ and the docs render them
beside each other.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEMA = 1
RESULTS_ENV = "MINDSPEED_LIKE_RESULTS"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def results_dir() -> Path:
    """Where records go: ``$MINDSPEED_LIKE_RESULTS``, else ``results/`` of this checkout."""
    return Path(os.environ.get(RESULTS_ENV) or _REPO_ROOT / "results")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _load_average() -> list[float] | None:
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except (AttributeError, OSError):  # not on every platform
        return None


def _source_revision() -> str:
    """The git commit of this checkout (with ``+dirty`` when it has changes), else the installed version."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(_REPO_ROOT), *args], capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()

    try:
        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("mindspeed_like")
        except PackageNotFoundError:
            return "unknown"


ACCELERATORS = ("cuda", "npu")


def device_record_name(name: str, device: str) -> str:
    """``name`` as the record of a run on ``device``: unchanged on a CPU, ``<name>-<device>`` on an
    accelerator (``attention`` -> ``attention-cuda``), so a GPU run never replaces a CPU record."""
    if device in ACCELERATORS and not name.endswith(f"-{device}"):
        return f"{name}-{device}"
    return name


def is_accelerator_record(name: str) -> bool:
    """A record name of a run on an accelerator (:func:`device_record_name`'s suffix)."""
    return name.endswith(tuple(f"-{device}" for device in ACCELERATORS))


def device_info(device: str) -> dict[str, Any]:
    """What a record says about the device it ran on: its type, and on an accelerator its name as
    the driver reports it, how many there are, and the CUDA / cuDNN builds torch runs with."""
    info: dict[str, Any] = {"device": device}
    if device not in ACCELERATORS:
        return info
    try:
        import torch

        module = getattr(torch, device)
        if not module.is_available():
            return dict(info, device_name=f"{device} (not available in this process)")
        info.update(device_name=module.get_device_name(module.current_device()), device_count=module.device_count())
        if device == "cuda":
            info.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    except Exception as error:  # a record is written whatever the driver says
        info["device_name"] = f"{device} (name unknown: {type(error).__name__}: {error})"
    return info


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {"python": platform.python_version()}
    for key, dist in (("torch", "torch"), ("megatron_core", "megatron-core"), ("triton", "triton")):
        try:
            found[key] = version(dist)
        except PackageNotFoundError:
            found[key] = None
    found["mindspeed_like"] = _source_revision()
    return found


class Record:
    """A run's record, started when created (time, load average) and completed by ``write``."""

    def __init__(self, name: str, *, command: Sequence[str] | None = None, device: str = "cpu") -> None:
        self.name = name
        self.command = list(command if command is not None else sys.argv)
        self.started_at = _now()
        self.host: dict[str, Any] = {
            "load_average_at_start": _load_average(),
            "hostname": platform.node(),
            "cpu_count": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(),
            "platform": platform.platform(),
            **device_info(device),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torchdynamo_disable": os.environ.get("TORCHDYNAMO_DISABLE"),
        }
        self._cpu_isa(device)
        self.options: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.samples: dict[str, list[float]] = {}
        self.extra: dict[str, Any] = {}  # figures that are not rows (targets met, verdicts, curves)
        # read at the start too: the revision that ran, not the one checked out when the run ended
        self.versions: dict[str, str | None] = versions()

    def set_device(self, device: str) -> None:
        """The run turned out to be on ``device`` (compare learns it from its arms)."""
        for key in ("device_name", "device_count", "cuda", "cudnn"):
            self.host.pop(key, None)
        self.host.update(device_info(device))
        self._cpu_isa(device)

    def _cpu_isa(self, device: str) -> None:
        """On a CPU run: the capability ATen and oneDNN ran at (ATEN_CPU_CAPABILITY /
        ONEDNN_MAX_CPU_ISA can hold them below the CPU's own) and the bf16-vs-fp32 GEMM probe, so a
        figure says which kind of host made it (kernels/host_gemm.py)."""
        self.host.pop("cpu_isa", None)
        if device != "cpu":
            return
        try:
            from mindspeed_like.kernels.host_gemm import host_isa

            self.host["cpu_isa"] = host_isa()
        except ImportError:  # torch absent (a record of a tool that does not need it)
            pass

    def add_row(self, **row: Any) -> None:
        self.rows.append(row)

    def add_samples(self, key: str, values: Sequence[float]) -> None:
        """Raw measurements behind a figure (e.g. each timed repeat of one path), kept as taken."""
        self.samples[key] = [float(v) for v in values]

    def to_dict(self) -> dict[str, Any]:
        try:
            import torch

            self.host["threads"] = torch.get_num_threads()
        except ImportError:
            pass
        return {
            "schema": SCHEMA,
            "name": self.name,
            "command": self.command,
            "started_at": self.started_at,
            "finished_at": _now(),
            "host": self.host,
            "versions": self.versions,
            "options": self.options,
            "rows": self.rows,
            "samples": self.samples,
            "extra": self.extra,
        }

    def write(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write to ``path``, or to ``results_dir()/<name>.json``; returns the path written."""
        target = Path(path) if path else results_dir() / f"{self.name}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=1, default=str)
            handle.write("\n")
        return target


def format_table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> list[str]:
    """Rows as a benchmark prints them (aligned columns, floats to 4 significant digits): the
    benchmarks' console output and ``make docs``' rendering of it are the same function."""
    columns = list(columns or dict.fromkeys(key for row in rows for key in row))  # every row's fields, in order
    cells = [[format_value(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = [f"== {title} ==", "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return lines


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A record from disk, checked for the fields every reader relies on."""
    with open(path, encoding="utf-8") as handle:
        record = json.load(handle)
    missing = [
        key for key in ("schema", "name", "command", "started_at", "host", "versions", "rows") if key not in record
    ]
    if missing:
        raise ValueError(f"{path}: not a measurement record (missing {', '.join(missing)})")
    if record["schema"] != SCHEMA:
        raise ValueError(f"{path}: record schema {record['schema']}, this reader knows {SCHEMA}")
    return record
