"""The benchmark convention: every script prints a table and always writes its measurement
record (``mindspeed_like.toolkit.records``): the command, versions, host with the load average
when the run started, every printed row, and each timed repeat's seconds for both paths.

Where the record goes: ``results/<script>.json`` (the records the docs' tables are rendered from,
``make docs``); ``results/<script>-quick.json`` with ``--quick`` (a smoke run never replaces a
documented record); on an accelerator the device type is appended (``results/<script>-cuda.json``,
beside the CPU record); ``--record NAME`` picks another name, ``--json PATH`` another file. Ratios
are always against megatron's own path measured in the same run, never against numbers from another
run.

The device: ``--device auto|cpu|cuda|npu`` (every script; ``auto``: an NPU, else a GPU, else the
CPU, as ``mindspeed-like compare`` picks). :func:`device` is where a script puts its tensors and
models; :func:`timed` synchronises the device before starting and after each call (host clocks
around a drained queue), after ``warmup`` untimed calls; :func:`peak_bytes` counts that device's
bytes. A script that measures something only a CPU host has (glibc's allocator, a simulated link
between host processes) says which devices it acts on (``parser(..., devices=("cpu",), why=...)``):
asked for another, it prints one line saying why and exits 0 without a record.

How a script uses it: ``common.parser(...).parse_args()`` starts the record (so the load average is
the one at the start of the run); ``common.median_seconds(fn, repeats, label="ours")`` (or
``common.timed``) keeps every repeat's seconds; ``Results.add(**row)`` files the samples timed since
the previous row under that row (``samples=`` names them explicitly); ``Results.write_json``
writes the record."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import profile
from torch.profiler._memory_profiler import Action

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # a plain `python benchmarks/x.py` from a checkout without install
    sys.path.insert(0, str(_ROOT))

from mindspeed_like.toolkit import records  # noqa: E402
from mindspeed_like.toolkit.cli_values import above, output_file, positive_int, record_name  # noqa: E402, F401 (scripts use common.above)

_RECORD: records.Record | None = None
_TABLES: list[Results] = []
_PENDING: list[tuple[str, list[float]]] = []
_DEVICE: torch.device | None = None
DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")


def script_name() -> str:
    """The running benchmark's name: its file's stem (``attention`` for benchmarks/attention.py)."""
    return Path(sys.argv[0]).stem or "benchmark"


class _Parser(argparse.ArgumentParser):
    """Parsing the arguments is where a benchmark run starts: the device is resolved and the
    record is created there."""

    devices: tuple[str, ...] = ("cpu", "cuda", "npu")
    why: str = ""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, rest = super().parse_known_args(args, namespace)
        if _RECORD is None:
            from mindspeed_like.adapters.detect import detect_device

            kind = detect_device(parsed.device)
            if kind not in self.devices:
                print(f"{script_name()}: not run on {kind}: {self.why}", flush=True)
                raise SystemExit(0)
            resolved = use_device(kind)
            parsed.device = resolved.type
            name = parsed.record or records.device_record_name(
                script_name() + ("-quick" if getattr(parsed, "quick", False) else ""), resolved.type
            )
            start(name, options=vars(parsed))
        return parsed, rest


def parser(description: str, devices: Sequence[str] | None = None, why: str = "") -> argparse.ArgumentParser:
    """The benchmark's argument parser: ``--json``, ``--record``, ``--repeats``, ``--quick``,
    ``--device``. ``devices``: where the script can act (default: all); ``why``: the one line a run
    elsewhere prints before exiting 0."""
    p = _Parser(description=description, allow_abbrev=False)
    if devices is not None:
        p.devices, p.why = tuple(devices), why
    p.add_argument(
        "--json",
        metavar="PATH",
        type=output_file,
        help="write the record to this file instead of results/<record>.json",
    )
    p.add_argument(
        "--record",
        metavar="NAME",
        type=record_name,
        help="record name (results/NAME.json); default: the script's name, with -quick for --quick",
    )
    p.add_argument("--repeats", type=positive_int, default=5, help="timed repeats per case (the median is reported)")
    p.add_argument("--quick", action="store_true", help="smaller shapes, for a smoke run")
    p.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default="auto",
        help="where tensors and models run (default auto: npu, else cuda, else cpu)",
    )
    return p


def use_device(requested: str = "auto") -> torch.device:
    """Resolve ``--device`` (``auto``: npu, else cuda, else cpu) and make it this run's device."""
    global _DEVICE
    from mindspeed_like.adapters.detect import detect_device

    kind = detect_device(requested)
    if kind == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    if kind in ("cuda", "npu") and not getattr(torch, kind).is_available():
        raise SystemExit(f"{script_name()}: --device {kind}, but torch sees no {kind} device here")
    _DEVICE = torch.device(kind, getattr(torch, kind).current_device()) if kind != "cpu" else torch.device("cpu")
    return _DEVICE


def device() -> torch.device:
    """This run's device (``--device``; the CPU when a script never parsed arguments)."""
    return _DEVICE if _DEVICE is not None else torch.device("cpu")


def on_accelerator() -> bool:
    return device().type != "cpu"


def sync() -> None:
    """Wait for the device's queued work (a no-op on a CPU): a host clock then measures it."""
    kind = device().type
    if kind != "cpu":
        getattr(torch, kind).synchronize()


def calls_per_sample() -> int:
    """Calls per timed sample: 1 on a CPU; 10 on an accelerator, where one fused op takes tens of
    microseconds and a synchronisation per call would weigh on every path alike."""
    return 1 if device().type == "cpu" else 10


def users_backend() -> contextlib.AbstractContextManager:
    """The kernel backend a user's run gets on this device: the portable one, forced on a CPU (as
    these benchmarks always did), the one the tensor's device picks elsewhere."""
    if device().type != "cpu":
        return contextlib.nullcontext()
    from mindspeed_like.kernels.backend import force_backend

    return force_backend("portable")


def anchor_columns(name: str, anchor_ms: float | None, ours_ms: float, missing: str | None) -> dict[str, Any]:
    """An anchor's two columns (another library's kernel on the same tensors): ``<name>_ms`` and
    ``vs_<name>`` (its time / ours: >= 1 when ours is at least as fast), or why it did not run."""
    if anchor_ms is None:
        return {f"{name}_ms": missing or "not run", f"vs_{name}": "-"}
    return {f"{name}_ms": anchor_ms, f"vs_{name}": anchor_ms / ours_ms}


def anchor_fails(fn: Callable[[], Any]) -> str | None:
    """Run an anchor's step once: None when it works, else the error in a few words (its column
    says so and the benchmark goes on: another library's kernel never stops our measurement)."""
    try:
        fn()
        sync()
    except Exception as error:
        text = f"failed: {type(error).__name__}: {error}".splitlines()[0][:160]
        print(f"anchor {text}", flush=True)
        return text
    return None


def init_process_group() -> None:
    """This process's one-rank default group with the device's collective backend (nccl on a GPU,
    hccl on an NPU; gloo on a CPU), before ``testing.init_parallel`` (which keeps an existing one):
    megatron's collectives then act on device tensors."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = {"cuda": "nccl", "npu": "hccl"}.get(device().type, "gloo")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def configure(**flags: Any) -> None:
    """``mindspeed_like.configure`` for this run's device (the CPU adapter on a CPU only)."""
    import mindspeed_like

    mindspeed_like.configure(device=device().type, **flags)


def start(name: str, options: dict[str, Any] | None = None) -> records.Record:
    """Start this run's record (the load average is read now); the parser calls it."""
    global _RECORD
    _RECORD = records.Record(name, device=device().type)
    _RECORD.options.update({k: v for k, v in (options or {}).items() if k not in ("json", "record")})
    return _RECORD


def record() -> records.Record:
    """This run's record, started on first use when a script never parsed arguments."""
    return _RECORD if _RECORD is not None else start(script_name())


def rename(name: str) -> None:
    """A mode that measures something else (``--curve``) writes its own record name."""
    record().name = name


def timed(
    fn: Callable[[], Any], repeats: int, warmup: int = 1, label: str | None = None, inner: int = 1
) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls, the device
    synchronised before each start and before each stop (``inner`` > 1: each sample is the mean of
    that many calls between the two synchronisations); with a ``label`` they are kept for the next
    ``Results.add`` row's samples."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        begin = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        times.append((time.perf_counter() - begin) / inner)
    if label is not None:
        add_samples(label, times)
    return times


def median_seconds(
    fn: Callable[[], Any], repeats: int, warmup: int = 1, label: str | None = None, inner: int = 1
) -> float:
    """Median of ``timed``; every repeat is kept in the record (under ``label``, or ``timing<n>``)."""
    times = timed(fn, repeats, warmup, inner=inner)
    add_samples(label or f"timing{len(_PENDING)}", times)
    return statistics.median(times)


QUICK_MODEL_SIZE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64)


def add_model_size_options(p: argparse.ArgumentParser, default: dict[str, int]) -> None:
    """``--num-layers``, ``--hidden-size``, ``--num-attention-heads``, ``--seq-length`` of a
    preset model (``default``; ``--quick``: :data:`QUICK_MODEL_SIZE`)."""
    for key in default:
        help_text = f"default {default[key]} (--quick: {QUICK_MODEL_SIZE[key]})"
        p.add_argument("--" + key.replace("_", "-"), type=positive_int, help=help_text)


def model_size(args: argparse.Namespace, default: dict[str, int]) -> dict[str, int]:
    """The size these arguments ask for (see :func:`add_model_size_options`)."""
    size = dict(QUICK_MODEL_SIZE if args.quick else default)
    size.update({key: getattr(args, key) for key in size if getattr(args, key) is not None})
    return size


WORKER_LINE = "ARM "
"""How a worker process's one-line JSON result starts (the rest of its output is megatron's logs)."""


def in_fresh_process(script: str, args: Sequence[str], what: str) -> dict[str, Any]:
    """``script`` run with ``args`` (the benchmark's own worker mode) in a new Python process; the
    result it printed with :func:`to_parent`. Arms that share a process measure each other's
    allocator state (benchmarks/host_allocator.py), so the MoE and allocator benchmarks give each
    arm its own. The worker's record goes nowhere (``--json`` /dev/null): the parent writes it."""
    command = [sys.executable, script, "--device", device().type, *args, "--json", os.devnull]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(WORKER_LINE)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(WORKER_LINE) :])


def to_parent(result: dict[str, Any]) -> None:
    """A worker's result, one line on stdout for :func:`in_fresh_process`."""
    print(WORKER_LINE + json.dumps(result), flush=True)


def add_samples(label: str, seconds: Sequence[float]) -> None:
    """Raw seconds of one path, filed under the next row added (``<table> | <case> | <label>``)."""
    _PENDING.append((label, [float(s) for s in seconds]))


_PEAK_FALLBACK_SAID: list[str] = []


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak of (bytes created - bytes destroyed) on this run's device while ``fn`` runs, from the
    profiler's memory timeline. Only tensors created inside ``fn`` count: freeing an older tensor
    (last step's gradients) must not lower the figure. On an accelerator where the profiler's
    timeline fails, the allocator's peak above what was allocated before ``fn`` (said once)."""
    kind = device().type
    try:
        with profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
            fn()
            sync()
        timeline = prof._memory_profile().timeline
    except Exception as error:
        if kind == "cpu":
            raise
        if not _PEAK_FALLBACK_SAID:
            _PEAK_FALLBACK_SAID.append(str(error))
            print(
                f"peak bytes: the profiler's memory timeline failed on {kind} ({error}); the allocator's peak instead"
            )
        return _allocator_peak_bytes(fn)
    current = peak = 0
    created: set = set()
    for _, action, (key, _version), size in timeline:
        if getattr(key, "device", None) is not None and key.device.type != kind:
            continue  # the host's bytes of an accelerator run (and the other way round)
        if action == Action.CREATE:
            created.add(key)
            current += size
        elif action == Action.DESTROY and key in created:
            created.discard(key)
            current -= size
        peak = max(peak, current)
    return peak


def _allocator_peak_bytes(fn: Callable[[], Any]) -> int:
    module = getattr(torch, device().type)
    sync()
    before = module.memory_allocated()
    module.reset_peak_memory_stats()
    fn()
    sync()
    return int(module.max_memory_allocated() - before)


def host() -> dict[str, Any]:
    return dict(record().host, threads=torch.get_num_threads(), torch=torch.__version__)


class Results:
    """Rows of one table of a benchmark; printed as an aligned table, all tables of the run
    written as one record (each row with ``table``: this table's name)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rows: list[dict[str, Any]] = []
        record()
        _TABLES.append(self)

    def add(self, samples: Any = None, **row: Any) -> None:
        """One row; the samples timed since the previous row (and ``samples``, a dict of label ->
        seconds) are filed under it. A ``samples`` that is not a dict is an ordinary field (a count)."""
        if samples is not None and not isinstance(samples, dict):
            row = {**row, "samples": samples}
            samples = None
        self.rows.append(row)
        case = " ".join(str(v) for k, v in row.items() if isinstance(v, str)) or f"row{len(self.rows) - 1}"
        pending = list(_PENDING) + [(label, list(values)) for label, values in (samples or {}).items()]
        _PENDING.clear()
        for label, values in pending:
            key = f"{self.name} | {case} | {label}"
            if key in record().samples:
                key = f"{self.name} | {case} #{len(self.rows) - 1} | {label}"
            record().add_samples(key, values)

    def print_table(self, columns: Sequence[str] | None = None) -> None:
        print("\n".join(records.format_table(self.name, self.rows, columns)))

    def write_json(self, path: str | None = None, **extra: Any) -> Path:
        """Write this run's record (every table's rows, ``extra`` figures that are not a table's
        rows) to ``path``, else results/<record>.json; returns where it went."""
        return write(path, **extra)


def write(path: str | None = None, **extra: Any) -> Path:
    rec = record()
    rec.rows = [dict(table=table.name, **row) for table in _TABLES for row in table.rows]
    rec.extra.update({k: v for k, v in extra.items() if not any(v is table.rows for table in _TABLES)})
    target = rec.write(path)
    print(f"wrote {target}")
    return target
