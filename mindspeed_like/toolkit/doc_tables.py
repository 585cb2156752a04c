"""``make docs``: the measured numbers in README.md, docs/index.md and docs/features/*.md rendered
from the measurement records in results/ (``mindspeed_like.toolkit.records``), so no figure in
the docs is typed by hand and none can go stale unnoticed.

Three kinds of generated region, each between an opening and a closing HTML comment (invisible
when the markdown is rendered); everything between them is rewritten by ``make docs``:

``<!-- table: ID (make docs) -->`` ... ``<!-- /table -->``
    a table from ``TABLES[ID]`` (this module; ``compare.NAME``: the compare record NAME;
    ``printed.NAME``: record NAME's table as its benchmark printed it), followed
    by one line per record it read saying when (the record's start time), where (host, CPU count,
    load average at the start, torch and megatron-core versions, git revision) and with which
    command it was measured.
``<!-- value: QUERY -->`` ... ``<!-- /value -->``
    one figure inside prose or a hand-written table cell, QUERY being
    ``RECORD[field=value,...].FIELD [min|max|range] [FORMAT [UNIT]]`` (FORMAT a Python format
    spec, e.g. ``.2f``; UNIT text appended to a number, e.g. ``x``, not to a "not measured yet"):
    the one row of RECORD matching the filters (or the min / max / "lo-hi" over all
    matching rows); ``RECORD.extra.KEY`` reads a figure the record keeps outside its rows.
``<!-- records: NAME NAME ... (make docs) -->`` ... ``<!-- /records -->``
    the when/where lines of the named records (under a table whose cells are values).

Records of an accelerator run (``<name>-cuda``, ``<name>-npu``: ``records.device_record_name``) are
rendered beside the CPU ones, their provenance line naming the device (``NVIDIA H100 80GB HBM3``,
CUDA, Triton); ``RECORD.host.KEY`` reads a field of the record's host (``attention-cuda.host.device_name``).
Where such a record is absent (no GPU run yet), its regions say so (:data:`NOT_MEASURED`) instead
of failing: a missing CPU record, or a missing row of a present record, is still an error.

``python -m mindspeed_like.toolkit.doc_tables`` rewrites every region; ``--check`` only compares
and exits 1 naming each file, region and first differing line (``tests/docs/test_doc_tables.py``
runs the check in ``make test``, so a hand edit of a generated number fails the suite).
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed_like.toolkit import records

REPO = Path(__file__).resolve().parents[2]


def doc_files(root: Path = REPO) -> list[Path]:
    """The documents whose numbers are rendered: README, docs/index.md, architecture.md, plan.md,
    megatron-lm.md (the flag sweep's tables), megatron-tests.md (Megatron-LM's unit tests per level),
    docs/features/*.md."""
    docs = root / "docs"
    return [
        root / "README.md",
        docs / "index.md",
        docs / "architecture.md",
        docs / "plan.md",
        docs / "megatron-lm.md",
        docs / "megatron-tests.md",
        *sorted((docs / "features").glob("*.md")),
    ]


class RecordError(LookupError):
    """A region names a record or a row that results/ does not have."""


class MissingRecord(RecordError):
    """results/ has no record of this name."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


NOT_MEASURED = "not measured yet (needs a GPU: make bench-gpu)"


def awaits_device(error: RecordError) -> bool:
    """The region names an accelerator's record that no run has written yet."""
    return isinstance(error, MissingRecord) and records.is_accelerator_record(error.name)


class Records:
    """The records of one results folder, read on first use; remembers which ones a region used."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = Path(folder) if folder else records.results_dir()
        self._cache: dict[str, dict[str, Any]] = {}
        self.used: list[str] = []  # by the region being rendered (its provenance lines)
        self.read: list[str] = []  # by every region so far

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self._cache:
            path = self.folder / f"{name}.json"
            if not path.exists():
                runs = "`make bench-gpu` on a GPU" if records.is_accelerator_record(name) else "`make bench`"
                raise MissingRecord(name, f"no record {name!r} ({path}): run the benchmark that writes it ({runs})")
            self._cache[name] = records.read(path)
        for seen in (self.used, self.read):
            if name not in seen:
                seen.append(name)
        return self._cache[name]

    def rows(self, name: str, table: str | None = None, **where: Any) -> list[dict[str, Any]]:
        """Rows of record ``name`` (of its table ``table``) whose fields equal ``where`` (as
        strings; a key ending in ``~`` matches when the field contains the value; ``max`` / ``min``
        as the value keeps the rows where that field is largest / smallest)."""
        extremes = {key: value for key, value in where.items() if value in ("max", "min")}
        found = [
            row
            for row in self[name]["rows"]
            if (table is None or row.get("table") == table)
            and all(
                _matches(row.get(key.rstrip("~")), value, key.endswith("~"))
                for key, value in where.items()
                if key not in extremes
            )
        ]
        for key, which in extremes.items():  # `s=max`: the rows at the largest s among the others' matches
            present = [row[key] for row in found if row.get(key) is not None]
            if present:
                target = max(present) if which == "max" else min(present)
                found = [row for row in found if row.get(key) == target]
        if not found:
            raise RecordError(f"record {name!r}: no row with {dict(where, table=table)}")
        return found

    def row(self, name: str, table: str | None = None, **where: Any) -> dict[str, Any]:
        found = self.rows(name, table, **where)
        if len(found) != 1:
            raise RecordError(f"record {name!r}: {len(found)} rows match {where}, a value needs exactly one")
        return found[0]


def _matches(field: Any, wanted: Any, contains: bool) -> bool:
    return str(wanted) in str(field) if contains else str(field) == str(wanted)


# -- formatting ---------------------------------------------------------------------------------


def fmt(value: Any, spec: str = "") -> str:
    """``format(value, spec)``; floats without a spec as the benchmarks print them (4 digits)."""
    if value is None:
        return "-"
    if isinstance(value, str):  # e.g. an anchor's column saying why it did not run
        return value
    if spec:
        return format(value, spec)
    return records.format_value(value)


def markdown(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


@dataclass(frozen=True)
class Col:
    """One column: header, the row's field (or a function of the row), a format, a unit."""

    header: str
    field: str | Callable[[dict[str, Any]], Any]
    spec: str = ""
    unit: str = ""

    def cell(self, row: dict[str, Any]) -> str:
        value = self.field(row) if callable(self.field) else row.get(self.field)
        text = fmt(value, self.spec if not isinstance(value, str) else "")
        return f"{text}{self.unit}" if isinstance(value, (int, float)) and self.unit else text


def columns_table(rows: Sequence[dict[str, Any]], cols: Sequence[Col]) -> list[str]:
    return markdown([c.header for c in cols], ([c.cell(row) for c in cols] for row in rows))


def printed(rec: dict[str, Any], table: str | None = None, columns: Sequence[str] | None = None) -> list[str]:
    """A benchmark's console table as it printed it, with the command, in a code block."""
    rows = [
        {k: v for k, v in row.items() if k != "table"}
        for row in rec["rows"]
        if table is None or row.get("table") == table
    ]
    title = table or (rec["rows"][0].get("table", rec["name"]) if rec["rows"] else rec["name"])
    return ["```", "$ " + command(rec), *records.format_table(title, rows, columns), "```"]


def command(rec: dict[str, Any]) -> str:
    argv = list(rec["command"])
    if argv and argv[0].endswith(".py") and "/" not in argv[0]:
        argv[0] = f"benchmarks/{argv[0]}"
    if argv and argv[0].endswith(".py"):
        argv = ["python", _relative(argv[0]), *argv[1:]]
    return " ".join(argv)


def _relative(path: str) -> str:
    if not Path(path).is_absolute():
        return path
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return path


def provenance(rec: dict[str, Any]) -> str:
    """When, where and how one record was measured (the line under every generated table)."""
    host, versions = rec["host"], rec["versions"]
    started = datetime.datetime.fromisoformat(rec["started_at"]).astimezone(datetime.timezone.utc)
    load = host.get("load_average_at_start")
    load_text = f"load average {load[0]:.2f} at start" if load else "load average unknown"
    threads = f", {host['threads']} thread{'s' if host['threads'] != 1 else ''}" if host.get("threads") else ""
    compiled = ", torch.compile off" if host.get("torchdynamo_disable") == "1" else ""
    isa = host.get("cpu_isa")
    isa_text = (
        f", ISA {isa['aten_cpu_capability']} (oneDNN {isa['onednn_max_cpu_isa']}, bf16 GEMMs "
        f"{'in fp32' if isa['bf16_gemm']['fp32_faster'] else 'native'})"
        if isa
        else ""
    )
    where = f"{host.get('hostname') or 'unknown host'} ({host.get('cpu_count')} CPUs{threads}{isa_text}, {load_text})"
    builds = ""
    if host.get("device") in records.ACCELERATORS:  # the device first: it is what the figures measure
        where = f"{host.get('device_name') or host['device']}, host {where}"
        builds = "".join(
            f", {label} {value}"
            for label, value in (("CUDA", host.get("cuda")), ("Triton", versions.get("triton")))
            if value
        )
    return (
        f"`{rec['name']}`: {started:%Y-%m-%d %H:%M} UTC on {where}, torch {versions.get('torch')}{builds}, "
        f"megatron-core {versions.get('megatron_core')}, mindspeed_like {versions.get('mindspeed_like')}{compiled}: "
        f"`{command(rec)}`"
    )


def provenance_lines(recs: Records, names: Sequence[str]) -> list[str]:
    lines = [""]
    for name in names:
        try:
            lines.append(f"<sub>Measured: {provenance(recs[name])}.</sub>")
        except RecordError as error:
            if not awaits_device(error):
                raise
            lines.append(f"<sub>`{name}`: {NOT_MEASURED}.</sub>")
    return lines


# -- inline values ------------------------------------------------------------------------------

_QUERY = re.compile(
    r"^(?P<record>[\w.-]+?)(?:\[(?P<where>[^\]]*)\])?\.(?P<field>(?:extra|host)\.[\w.]+|\w+)"
    r"(?:\s+(?P<agg>min|max|range))?(?:\s+(?P<spec>\S+))?(?:\s+(?P<unit>\S+))?$"
)


def value(recs: Records, query: str) -> str:
    """The text of one ``<!-- value: QUERY -->`` region (grammar in the module docstring)."""
    match = _QUERY.match(query.strip())
    if not match:
        raise RecordError(
            f"value query {query!r}: expected RECORD[field=value,...].FIELD [min|max|range] [FORMAT [UNIT]]"
        )
    text = _value(recs, match)
    unit = match["unit"] or ""
    return f"{text}{unit}" if unit and re.fullmatch(r"[-+]?[\d.,]+%?", text) else text


def _value(recs: Records, match: re.Match) -> str:
    name, field, agg, spec = match["record"], match["field"], match["agg"], match["spec"] or ""
    if field.startswith(("extra.", "host.")):
        part, _, path = field.partition(".")
        found: Any = recs[name].get(part, {})
        for key in path.split("."):
            if key not in found:
                raise RecordError(f"record {name!r}: no {part} field {path!r}")
            found = found[key]
        return fmt(found, spec)
    where = {}
    # filters are separated by the commas that start another `key=` / `key~` (a value may hold ", ")
    for part in re.split(r",(?=\s*\w+\s*[=~])", match["where"] or ""):
        if part.strip():
            found_filter = re.match(r"\s*(\w+)\s*([=~])(.*)", part, re.S)
            if not found_filter:
                raise RecordError(f"value query {match.string!r}: filter {part!r} is not field=value or field~text")
            key, op, wanted = found_filter.groups()
            where[key + ("~" if op == "~" else "")] = wanted.strip()
    table = where.pop("table", None)
    if agg is None:
        row = recs.row(name, table, **where)
        if field not in row:
            raise RecordError(f"record {name!r}: the row {where} has no field {field!r}")
        return fmt(row[field], spec)
    values = [row[field] for row in recs.rows(name, table, **where) if row.get(field) is not None]
    if not values:
        raise RecordError(f"record {name!r}: no row {where} has the field {field!r}")
    if agg == "min":
        return fmt(min(values), spec)
    if agg == "max":
        return fmt(max(values), spec)
    low, high = fmt(min(values), spec), fmt(max(values), spec)
    return low if low == high else f"{low}-{high}"


# -- the tables ---------------------------------------------------------------------------------

Renderer = Callable[[Records], list[str]]
TABLES: dict[str, Renderer] = {}


def table(name: str) -> Callable[[Renderer], Renderer]:
    def register(fn: Renderer) -> Renderer:
        TABLES[name] = fn
        return fn

    return register


def _printed_table(name: str, record: str, table_name: str | None = None) -> None:
    TABLES[name] = lambda recs: printed(recs[record], table_name)


for _name in (
    "attention",
    "fused_ops_rmsnorm",
    "fused_ops_rope",
    "grouped_gemm",
    "param_memory",
    "recompute_activation",
    "tp_overlap",
    "moe_alltoall_overlap",
    "moe_permute",
    "moe_router",
    "host_allocator",
):
    _printed_table(f"{_name}.printed", _name)


@table("fused_ops_swiglu")
def _swiglu(recs: Records) -> list[str]:
    return columns_table(
        recs.rows("fused_ops_swiglu"),
        [
            Col("op", "op"),
            Col("dtype", "dtype"),
            Col("shape", "shape"),
            Col("megatron", "megatron_ms", unit=" ms"),
            Col("ours", "ours_ms", unit=" ms"),
            Col("ours eager", "ours_eager_ms", unit=" ms"),
            Col("speedup", "speedup", ".2f", "x"),
            Col("megatron saved", "megatron_saved_MiB", ".0f", " MiB"),
            Col("ours saved", "ours_saved_MiB", ".0f", " MiB"),
        ],
    )


@table("optimizer_state")
def _optimizer_state(recs: Records) -> list[str]:
    return columns_table(
        recs.rows("optimizer_state"),
        [
            Col("DP", "DP"),
            Col("case", "case"),
            Col("B/param", "B_per_param", ".3f"),
            Col("target", lambda row: row.get("target") or ""),
            Col("vs megatron", "vs_megatron", ".3f"),
            Col("step ms", "step_ms", ".1f"),
            Col("step vs megatron", "step_vs_megatron", ".2f"),
        ],
    )


@table("optimizer_state-curve")
def _optimizer_curve(recs: Records) -> list[str]:
    return columns_table(
        recs.rows("optimizer_state-curve"),
        [
            Col("states", "state"),
            Col("first loss", "first", ".3f"),
            Col("final loss (mean of the last 20)", "final_mean20", ".4f"),
            Col("vs fp32 states", lambda row: f"{row['vs_fp32'] * 100:+.2f} %"),
        ],
    )


@table("linear_cross_entropy")
def _linear_cross_entropy(recs: Records) -> list[str]:
    return columns_table(
        recs.rows("linear_cross_entropy", table="linear_cross_entropy"),
        [
            Col("TP", "tp"),
            Col("vocab", "vocab"),
            Col("megatron", "megatron_ms", ".0f", " ms"),
            Col("ours", "ours_ms", ".0f", " ms"),
            Col("time", "time_ratio", ".2f", "x"),
            Col("megatron peak", "megatron_peak_MiB", ".0f", " MiB"),
            Col("our peak", "ours_peak_MiB", ".0f", " MiB"),
            Col("peak lower by", "memory_ratio", ".2f", "x"),
        ],
    )


CP_MEMORY = "context_parallel memory (same total sequence)"


@table("context_parallel.memory")
def _context_parallel_memory(recs: Records) -> list[str]:
    return columns_table(
        recs.rows("context_parallel", table=CP_MEMORY),
        [
            Col("CP", "cp"),
            Col("saved for backward", "saved_MiB", ".1f", " MiB"),
            Col("vs CP=1", "saved_ratio", ".2f", "x"),
            Col("peak added", "peak_MiB", ".1f", " MiB"),
            Col("vs CP=1", "peak_ratio", ".2f", "x"),
        ],
    )


@table("context_parallel.longest")
def _context_parallel_longest(recs: Records) -> list[str]:
    return columns_table(
        recs.rows("context_parallel", table="context_parallel longest sequence within the budget"),
        [Col("CP", "cp"), Col("budget", "budget_MiB", ".0f", " MiB"), Col("longest sequence", "longest_seq")]
        + [Col("vs CP=1", "vs_cp1", ".1f", "x")],
    )


@table("import_overhead")
def _import_overhead(recs: Records) -> list[str]:
    return columns_table(
        recs.rows("import_overhead"),
        [
            Col("case", "case"),
            Col("seconds", "seconds", ".3f"),
            Col("ratio vs megatron alone", "ratio_vs_megatron", ".3f"),
            Col("extra ms", "extra_ms", ".0f"),
        ],
    )


@table("moe_router")
def _moe_router(recs: Records) -> list[str]:
    return columns_table(
        recs.rows("moe_router"),
        [
            Col("op", "op"),
            Col("dtype", "dtype"),
            Col("shape", "shape"),
            Col("megatron eager", "megatron_eager_ms", ".2f", " ms"),
            Col("megatron compiled", "megatron_compiled_ms", ".2f", " ms"),
            Col("ours", "ours_ms", ".2f", " ms"),
            Col("vs eager", "vs_eager", ".2f", "x"),
            Col("vs compiled", "vs_compiled", ".2f", "x"),
            Col("megatron saved", "megatron_saved_MiB", ".2f", " MiB"),
            Col("ours saved", "ours_saved_MiB", ".2f", " MiB"),
        ],
    )


@table("moe_permute")
def _moe_permute(recs: Records) -> list[str]:
    return columns_table(
        recs.rows("moe_permute"),
        [
            Col("case", "case"),
            Col("dtype", "dtype"),
            Col("shape", "shape"),
            Col("megatron ms", "megatron_ms", ".1f"),
            Col("megatron compiled ms", lambda r: r["megatron_compiled_ms"], ".1f"),
            Col("ours ms", "ours_ms", ".1f"),
            Col("speedup", "speedup", ".2f", "x"),
            Col("megatron saved MiB", "megatron_saved_MiB", ".2f"),
            Col("ours saved MiB", "ours_saved_MiB", ".2f"),
            Col("megatron peak MiB", "megatron_peak_MiB", ".1f"),
            Col("ours peak MiB", "ours_peak_MiB", ".1f"),
        ],
    )


_COMPARE_ROWS = (
    ("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
    ("step time (median)", "step_time_s", lambda v: f"{v * 1e3:,.0f} ms"),
    ("weights MiB", "weights_bytes", lambda v: f"{v / 2**20:,.1f}"),
    ("gradients MiB", "gradients_bytes", lambda v: f"{v / 2**20:,.1f}"),
    ("optimizer state MiB", "optimizer_bytes", lambda v: f"{v / 2**20:,.1f}"),
    ("weights + gradients + optimizer MiB", "model_state_bytes", lambda v: f"{v / 2**20:,.1f}"),
    ("activations MiB (saved for backward)", "activations_bytes", lambda v: f"{v / 2**20:,.1f}"),
    ("process peak MiB", "process_peak_bytes", lambda v: f"{v / 2**20:,.1f}"),
    ("achieved model TFLOP/s (compare/flops.py)", "model_flops_per_s", lambda v: f"{v / 1e12:,.3g}"),
    ("model FLOP utilisation (of the measured bf16 peak)", "mfu", lambda v: f"{v:.1%}"),
)


def compare_table(recs: Records, name: str) -> list[str]:
    """A `mindspeed-like compare` record (rows: one per metric, both paths and the ratio's median
    with its min-max over the repeats) as the table the command prints."""
    by_metric = {row["metric"]: row for row in recs[name]["rows"] if "metric" in row}
    lines = []
    for label, metric, show in _COMPARE_ROWS:
        row = by_metric.get(metric)
        if row is None or row.get("megatron") is None:  # e.g. no MFU without a measured peak
            continue
        ratio = row.get("ratio")
        text = "-" if ratio is None else f"{ratio:.2f}x"
        low, high = row.get("ratio_min"), row.get("ratio_max")
        if ratio is not None and (row.get("repeats") or 1) > 1 and low is not None and f"{low:.2f}" != f"{high:.2f}":
            text += f" ({low:.2f}-{high:.2f} over {row['repeats']} repeats)"
        lines.append((label, show(row["megatron"]), show(row["features"]), text))
    first, final = by_metric.get("loss_first"), by_metric.get("loss_final")
    diff = by_metric.get("loss_max_abs_diff")
    if first and final:
        lines.append(
            (
                "loss first / last",
                f"{first['megatron']:.4f} / {final['megatron']:.4f}",
                f"{first['features']:.4f} / {final['features']:.4f}",
                f"max abs diff {diff['value']:.2e}" if diff else "",
            )
        )
    out = markdown(("per rank", "megatron", "with features", "features / megatron"), lines)
    extra = recs[name].get("extra", {})
    if extra.get("peak_flops_per_s"):
        out += [
            "",
            f"Measured bf16 matmul peak: {extra['peak_flops_per_s'] / 1e12:,.0f} TFLOP/s ({extra['peak_how']}).",
        ]
    reached = by_metric.get("features_reached")
    if reached:
        out += ["", "Features reached: " + (", ".join(reached["value"]) or "none") + "."]
    return out


LEAN_STATE_RELEASES = (
    "compare-plan-llama-dp2-mfsdp-level2",
    "lean-state-compare-llama-dp2-mfsdp-level2-mc0.17",
    "lean-state-compare-llama-dp2-mfsdp-level2-mc0.18",
    "lean-state-compare-llama-dp2-mfsdp-level2-mc0.19",
)
"""megatron-fsdp-lean-state's compare records, one per megatron-core release it serves (the same command)."""


@table("megatron_fsdp_lean_state_releases")
def _megatron_fsdp_lean_state_releases(recs: Records) -> list[str]:
    """Per release: compare's model state a rank (the most of the ranks), megatron's arm and the features
    arm, in bytes and in bytes a parameter (the weights are the bf16 shard: one byte a parameter at DP=2)."""
    lines = []
    for name in LEAN_STATE_RELEASES:
        record = recs[name]
        by_metric = {row["metric"]: row for row in record["rows"] if "metric" in row}
        state, weights = by_metric["model_state_bytes"], by_metric["weights_bytes"]["megatron"]
        lines.append(
            (
                record["versions"]["megatron_core"],
                f"{state['megatron']:,}",
                f"{state['features']:,}",
                f"{weights:,}",
                f"{state['megatron'] / weights:.2f}",
                f"{state['features'] / weights:.2f}",
                f"{state['ratio']:.2f}x",
            )
        )
    header = ("megatron-core", "megatron B", "lean B", "weights B (1 a param)", "megatron B/param", "lean B/param")
    return markdown((*header, "ratio"), lines)


def _moe_results(record: str) -> Renderer:
    def render(recs: Records) -> list[str]:
        return columns_table(
            recs.rows(record, table="moe"),
            [
                Col("preset", "preset"),
                Col("level", "level"),
                Col("megatron tokens/s", "megatron_tokens_per_s", ".1f"),
                Col("ours", "ours_tokens_per_s", ".1f"),
                Col("tokens/s ratio", "tokens_per_s_ratio", ".2f", "x"),
                Col("activations ratio", "activations_ratio", ".2f", "x"),
            ],
        )

    return render


def _moe_breakdown(record: str) -> Renderer:
    regions = ("step", "router", "permute", "experts", "unpermute", "attention", "other")

    def render(recs: Records) -> list[str]:
        return columns_table(
            recs.rows(record, table="moe time per step (forward + backward, ms)"),
            [Col("preset", "preset"), Col("arm", "arm"), *(Col(region, region, ".0f") for region in regions)],
        )

    return render


# benchmarks/moe.py at its default size (record "moe") and at issue 30's size ("moe-issue-size")
for _record in ("moe", "moe-issue-size"):
    table(_record)(_moe_results(_record))
    table(f"{_record}.breakdown")(_moe_breakdown(_record))


# `mindspeed-like plan` against measurement (python -m mindspeed_like.plan.accuracy / .fit_check --record)
def _signed_pct(value: Any) -> str:
    return "-" if value is None else f"{value:+.2f}%"


def _theory_errors(row: dict[str, Any]) -> str:
    state, activations = row["theory_error_model_state_pct"], row["theory_error_activations_pct"]
    return f"{_signed_pct(state)} / {_signed_pct(activations)}"


@table("plan_accuracy")
def _plan_accuracy(recs: Records) -> list[str]:
    """Per compare record and arm: measured per rank, the plan's error, report_theoretical_memory's."""
    return _plan_accuracy_of(recs, "plan-accuracy")


@table("plan_accuracy_cuda")
def _plan_accuracy_cuda(recs: Records) -> list[str]:
    """The same for the compare records of a GPU (their peak: ``torch.cuda.max_memory_allocated``)."""
    return _plan_accuracy_of(recs, "plan-accuracy-cuda")


def _plan_accuracy_of(recs: Records, record: str) -> list[str]:

    def measured_and_error(short: str) -> Col:
        def cell(row: dict[str, Any]) -> str:
            return f"{row[f'measured_{short}'] / 2**20:,.1f} ({_signed_pct(row[f'error_{short}_pct'])})"

        return Col(f"{short.replace('_', ' ')} MiB (plan's error)", cell)

    return columns_table(
        recs.rows(record, table="plan_accuracy"),
        [
            Col("case", "case"),
            Col("arm", "arm"),
            measured_and_error("model_state"),
            measured_and_error("activations"),
            measured_and_error("process_peak"),
            Col("Megatron-LM theory: state / activations", _theory_errors),
            Col("note", lambda row: row.get("notes") or ""),
        ],
    )


@table("plan_fit")
def _plan_fit(recs: Records) -> list[str]:
    return columns_table(
        recs.rows("plan-fit", table="plan_fit"),
        [
            Col("case", "case"),
            Col("budget MiB", "budget_MiB", ",.0f"),
            Col("megatron's peak MiB", "megatron_peak_MiB", ",.0f"),
            Col("levels measured", "levels_measured"),
            Col("--fit chose level", "recommended_level"),
            Col("predicted peak MiB", "predicted_peak_MiB", ",.0f"),
            Col("measured peak MiB", "measured_peak_MiB", ",.0f"),
            Col("step time vs the best fitting level", "time_vs_best_fitting", ".2f", "x"),
            Col("verdict", "verdict"),
        ],
    )


@table("plan_megatron_lm")
def _plan_megatron_lm(recs: Records) -> list[str]:
    """Megatron-LM's own runs on a CPU host: each rank's printed peak against the plan's."""
    return columns_table(
        recs.rows("plan-megatron-lm", table="plan_megatron_lm"),
        [
            Col("case", "case"),
            Col("rank", "rank"),
            Col("Megatron-LM's max allocated MiB (median)", "measured_MiB", ",.0f"),
            Col("each run's MiB", lambda row: row.get("runs_MiB") or "-"),
            Col("plan's process peak MiB", "predicted_MiB", ",.0f"),
            Col("plan's error", lambda row: _signed_pct(row["error_pct"])),
        ],
    )


def _state_and_activations(row: dict[str, Any]) -> str:
    return f"{row['plan_state_MiB']:,.0f} / {row['plan_activations_MiB']:,.0f}"


@table("plan_megatron_lm_cuda")
def _plan_megatron_lm_cuda(recs: Records) -> list[str]:
    """Megatron-LM's own runs on one GPU: the printed max allocated against the plan's peak, with
    Megatron-LM's own report_theoretical_memory beside them."""
    return columns_table(
        recs.rows("plan-megatron-lm-cuda", table="plan_megatron_lm_cuda"),
        [
            Col("case", "case"),
            Col("Megatron-LM's max allocated MiB", "measured_MiB", ",.0f"),
            Col("plan's peak MiB", "predicted_MiB", ",.0f"),
            Col("plan's error", lambda row: _signed_pct(row["error_pct"])),
            Col("plan: state / activations MiB", _state_and_activations),
            Col(
                "report_theoretical_memory MiB",
                lambda r: (
                    f"{r['megatron_theory_MiB']:,.0f} ({r['megatron_theory_is']})"
                    if r.get("megatron_theory_MiB") is not None
                    else "-"
                ),
            ),
        ],
    )


# -- rendering a document -----------------------------------------------------------------------

# a marker quoted in backticks (docs/architecture.md describing them) is text, not a region
_REGION = re.compile(
    r"(?P<open>(?<!`)<!-- (?P<kind>table|value|records): (?P<arg>[^\n]*?)(?: \(make docs\))? -->)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- /(?P=kind) -->)",
    re.S,
)


# The Megatron-LM flag sweep (tests/megatron_lm_flags, `make test-megatron-lm-flags`): one row per case.
_FLAG_OUTCOMES = (
    ("same losses", "same"),
    ("changed losses", "changed"),
    ("no training", "no training"),
    ("stopped by the rerun machine", "stopped by the rerun machine"),
    ("refused (message)", "refused"),
    ("stopped by Megatron-LM at start-up", "stopped at start-up"),
    ("crashed", ("crashed at start-up", "crashed mid-run", "hung")),
    ("not tried", "not tried"),
)


@table("megatron_lm_flags")
def _megatron_lm_flags(recs: Records) -> list[str]:
    """Per argument group: the flags tried and what they did."""
    rows = recs.rows("megatron-lm-flags")
    groups = list(dict.fromkeys(row["group"] for row in rows))

    def count(group_rows: list[dict[str, Any]], outcome: str | tuple[str, ...]) -> int:
        wanted = (outcome,) if isinstance(outcome, str) else outcome
        return sum(row["outcome"] in wanted for row in group_rows)

    table_rows = []
    for group in [*groups, None]:
        group_rows = [row for row in rows if group is None or row["group"] == group]
        tried = len(group_rows) - count(group_rows, "not tried")
        table_rows.append([group or "**all**", tried, *(count(group_rows, outcome) for _, outcome in _FLAG_OUTCOMES)])
    return markdown(["group", "tried", *(header for header, _ in _FLAG_OUTCOMES)], table_rows)


def _placeholders(text: str) -> str:
    """The sweep's per-run paths as words: a fresh directory, a file, the checkpoint it saved."""
    return text.replace("{tmp_dir}", "DIR").replace("{tmp_file}", "FILE").replace("{checkpoint}", "CHECKPOINT")


@table("megatron_lm_flags.all")
def _megatron_lm_flags_all(recs: Records) -> list[str]:
    """Every case: the flag as passed, what it ran beside, its outcome and the evidence."""

    def detail(row: dict[str, Any]) -> str:
        return " ".join(str(row["detail"]).replace("|", "\\|").split())[:240]

    return columns_table(
        recs.rows("megatron-lm-flags"),
        [
            Col("flag", lambda row: "`" + _placeholders(row["flag"]) + "`"),
            Col("group", "group"),
            Col("beside", lambda row: f"`{row['companions']}`" if row["companions"] else ""),
            Col("outcome", "outcome"),
            Col("what it did", detail),
        ],
    )


# -- Megatron-LM's unit tests on a CPU host (results/megatron-unit-<level>.json) ----------------------


def _megatron_unit_dirs(level: int) -> Renderer:
    """Per directory: collected, passed, failed, skipped, pass rate and the most frequent classes."""

    def render(recs: Records) -> list[str]:
        name = f"megatron-unit-{level}"
        rows = recs.rows(name, table="dirs")
        extra = recs[name]["extra"]

        def classes(row: dict[str, Any]) -> str:
            return ", ".join(f"{cls} {n}" for cls, n in list(row["classes"].items())[:4])

        body = [
            [f"`{r['dir']}`", r["collected"], r["passed"], r["failed"], r["skipped"], f"{r['passed_pct']:.1f}%",
             classes(r)]
            for r in rows
        ]  # fmt: skip
        body.append(
            ["**all**", extra["collected"], extra["passed"], extra["failed"], extra["skipped"],
             f"{extra['passed_pct']:.1f}%", f"wall time {extra['wall_s'] / 60:.1f} min"]
        )  # fmt: skip
        return markdown(
            ["directory", "collected", "passed", "failed", "skipped", "passed", "classes (most first)"], body
        )

    return render


def _megatron_unit_classes(level: int) -> Renderer:
    """Every class of a test that did not pass at this level: failed and skipped counts, what it would take."""

    def render(recs: Records) -> list[str]:
        extra = recs[f"megatron-unit-{level}"]["extra"]
        failed, skipped = extra["failure_classes"], extra["skip_classes"]
        names = sorted({*failed, *skipped}, key=lambda c: (-(failed.get(c, 0) + skipped.get(c, 0)), c))
        takes = extra.get("what_it_would_take", {})
        return markdown(
            ["class", "failed", "skipped", "what it would take"],
            [[f"`{c}`", failed.get(c, 0), skipped.get(c, 0), takes.get(c) or "see the reasons in the record"]
             for c in names],
        )  # fmt: skip

    return render


def _megatron_unit_regressions(level: int) -> Renderer:
    """Tests that pass at level 0 and do not pass at this level (same checkout, same directories)."""

    def render(recs: Records) -> list[str]:
        passed0 = {r["test"]: r for r in recs.rows("megatron-unit-0", table="tests") if r["outcome"] == "passed"}
        lost, not_run = [], []
        for r in recs.rows(f"megatron-unit-{level}", table="tests"):
            if r["test"] not in passed0 or r["outcome"] == "passed":
                continue
            # set aside for more ranks at this level (its pieces launched the size for other directories
            # only, or not at all): not run here
            (not_run if r["class"] == "needs-more-ranks" else lost).append(r)
        lines = [] if lost else [f"No test that passes at level 0 fails or skips at level {level}."]
        if not_run:
            size_counts = {}
            for r in not_run:
                size = passed0[r["test"]]["world_size"]
                size_counts[size] = size_counts.get(size, 0) + 1
            said = ", ".join(f"{n} at {size} ranks" for size, n in sorted(size_counts.items()))
            lines += ["", f"Not run at level {level} (set aside for more ranks than its pieces launched for their "
                      f"directories): {len(not_run)} tests that pass at level 0 ({said})."]  # fmt: skip
        if not lost:
            return lines
        return markdown(
            ["test", "outcome", "class", "reason"],
            [[f"`{r['test'].split('unit_tests/', 1)[-1]}`", r["outcome"], r["class"],
              " ".join(str(r["reason"]).replace("|", "\\|").split())[:200]] for r in lost],
        ) + lines  # fmt: skip

    return render


for _level in (0, 1, 2):
    TABLES[f"megatron_unit.{_level}"] = _megatron_unit_dirs(_level)
    TABLES[f"megatron_unit_classes.{_level}"] = _megatron_unit_classes(_level)
    if _level:
        TABLES[f"megatron_unit_regressions.{_level}"] = _megatron_unit_regressions(_level)


@dataclass
class Difference:
    """One generated region whose text is not what the records render."""

    path: Path
    line: int
    region: str
    expected: str
    found: str

    def __str__(self) -> str:
        return (
            f"{_relative(str(self.path))}:{self.line}: {self.region} differs from what results/ renders "
            f"(hand-edited? run `make docs`)\n  in the doc: {self.found}\n  from records: {self.expected}"
        )


def render_region(kind: str, arg: str, recs: Records) -> str:
    """A region's text; an absent accelerator record renders :data:`NOT_MEASURED` (``awaits_device``)."""
    try:
        return _render_region(kind, arg, recs)
    except RecordError as error:
        if not awaits_device(error):
            raise
        name = error.name  # type: ignore[attr-defined]
        if kind == "value":
            return NOT_MEASURED
        return f"\n{NOT_MEASURED} (record `{name}`)\n"


def _render_region(kind: str, arg: str, recs: Records) -> str:
    if kind == "value":
        return value(recs, arg)
    if kind == "records":
        return "\n".join(provenance_lines(recs, arg.split())) + "\n"
    if arg.startswith("compare."):  # any compare record: `compare.<record name>`
        renderer: Renderer = lambda recs: compare_table(recs, arg.removeprefix("compare."))  # noqa: E731
    elif arg.startswith("printed."):  # any benchmark's console table: `printed.<record name>`
        renderer = lambda recs: printed(recs[arg.removeprefix("printed.")])  # noqa: E731
    elif arg in TABLES:
        renderer = TABLES[arg]
    else:
        raise RecordError(f"no table {arg!r} in mindspeed_like/toolkit/doc_tables.py (known: {', '.join(TABLES)})")
    recs.used.clear()
    lines = renderer(recs)
    return "\n" + "\n".join([*lines, *provenance_lines(recs, list(recs.used))]) + "\n"


def render(text: str, recs: Records, path: Path | None = None) -> tuple[str, list[Difference]]:
    """The document with every region re-rendered, and the regions that differed."""
    differences: list[Difference] = []
    out: list[str] = []
    last = 0
    for match in _REGION.finditer(text):
        try:
            body = render_region(match["kind"], match["arg"].strip(), recs)
        except (RecordError, ValueError) as err:
            line = text.count("\n", 0, match.start()) + 1
            raise RecordError(f"{path}:{line}: {match['open']}: {err}") from err
        if body != match["body"]:
            differences.append(_difference(path, text, match, body))
        out += [text[last : match.start()], match["open"], body, match["close"]]
        last = match.end()
    out.append(text[last:])
    return "".join(out), differences


def _difference(path: Path | None, text: str, match: re.Match, body: str) -> Difference:
    old, new = match["body"].split("\n"), body.split("\n")
    index = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    start = text.count("\n", 0, match.start("body")) + 1
    return Difference(
        path=path or Path("<text>"),
        line=start + index,
        region=f"{match['kind']} {match['arg'].strip()!r}",
        expected=new[index] if index < len(new) else "(nothing)",
        found=old[index] if index < len(old) else "(nothing)",
    )


def regions(text: str) -> list[tuple[str, str]]:
    return [(m["kind"], m["arg"].strip()) for m in _REGION.finditer(text)]


def run(paths: Sequence[Path], folder: Path | None = None, *, check: bool) -> list[Difference]:
    recs = Records(folder)
    differences: list[Difference] = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        rendered, found = render(text, recs, path)
        differences += found
        if found and not check:
            path.write_text(rendered, encoding="utf-8")
    return differences


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 naming each differing region")
    parser.add_argument("--results", type=Path, help="records folder (default: results/ of this checkout)")
    parser.add_argument("paths", nargs="*", type=Path, help="documents (default: README, docs/index.md, features)")
    args = parser.parse_args(argv)
    paths = args.paths or doc_files()
    try:
        differences = run(paths, args.results, check=args.check)
    except RecordError as err:
        print(err, file=sys.stderr)
        return 2
    for difference in differences:
        print(difference, file=sys.stderr if args.check else sys.stdout)
    if args.check:
        return 1 if differences else 0
    print(f"make docs: {len(differences)} region(s) rewritten in {len(paths)} document(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
