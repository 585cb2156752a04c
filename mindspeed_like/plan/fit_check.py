"""`--fit` checked against measurement: for each compare configuration measured at several levels
(results/compare-*.json: megatron's arm is level 0, each record's features arm one level), a
budget below megatron's measured peak, the level `--fit` recommends, and whether that level's
measured peak is within the budget and its measured step time within 15% of the fastest measured
level that fits.

    python -m mindspeed_like.plan.fit_check            # the table
    python -m mindspeed_like.plan.fit_check --record   # also results/plan-fit.json (docs/plan.md)

The budget is halfway between megatron's measured peak and the largest measured peak of the other
levels: level 0 does not fit, the others do, and `--fit` must choose between them by time. Step
times are compared as each record measured them against its own megatron arm (ratio x the first
record's megatron time), so records taken at different loads stay comparable.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mindspeed_like.plan.accuracy import compare_records, host_text, run_text
from mindspeed_like.plan.fit import DEFAULT_HEADROOM
from mindspeed_like.toolkit import records

RECORD = "plan-fit"
TABLE = "plan_fit"
TIME_TOLERANCE = 0.15
# options that do not change the configuration (the level is what the fit chooses)
_RUN_ONLY = {"flags", "resolved_flags", "steps", "repeats", "out", "record", "timeout", "quiet", "threads"}


@dataclass(frozen=True)
class Measured:
    peak: float  # largest rank
    seconds: float  # normalised step time (see module docstring)
    records: tuple[str, ...]


@dataclass(frozen=True)
class FitCase:
    label: str
    options: dict[str, Any]
    levels: dict[int, Measured]
    budget: float
    recommended: int
    predicted_peak: int
    command: str

    @property
    def fitting(self) -> dict[int, Measured]:
        return {level: m for level, m in self.levels.items() if m.peak <= self.budget}

    @property
    def peak_ok(self) -> bool:
        return self.recommended in self.levels and self.levels[self.recommended].peak <= self.budget

    @property
    def time_vs_best(self) -> float | None:
        if self.recommended not in self.levels or not self.fitting:
            return None
        best = min(m.seconds for m in self.fitting.values())
        return self.levels[self.recommended].seconds / best

    @property
    def ok(self) -> bool:
        ratio = self.time_vs_best
        return self.peak_ok and ratio is not None and ratio <= 1 + TIME_TOLERANCE


def _key(options: dict[str, Any]) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in options.items() if k not in _RUN_ONLY))


def grouped() -> dict[tuple, list[dict[str, Any]]]:
    """Compare records by configuration (everything but the level and the run length)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for path in compare_records():
        rec = records.read(path)
        level = (rec["options"].get("flags") or {}).get("optimization_level")
        if level is None or set(rec["options"].get("flags") or {}) - {"optimization_level"}:
            continue
        # one host kind a group: levels measured where bf16 GEMMs run natively and where they run in
        # fp32 (an AVX2 host) are not one configuration's levels
        groups.setdefault((*_key(rec["options"]), host_text(rec)), []).append(rec)
    return {k: v for k, v in groups.items() if len({(r["options"]["flags"]["optimization_level"]) for r in v}) >= 2}


def measured_levels(recs: list[dict[str, Any]]) -> dict[int, Measured]:
    def row(rec: dict[str, Any], metric: str) -> dict[str, Any]:
        return next(r for r in rec["rows"] if r.get("metric") == metric)

    reference = row(recs[0], "step_time_s")["megatron"]
    out: dict[int, Measured] = {}
    meg_peaks = [max(row(r, "process_peak_bytes")["megatron_per_rank"]) for r in recs]
    out[0] = Measured(statistics.median(meg_peaks), reference, tuple(r["name"] for r in recs))
    for rec in recs:
        level = int(rec["options"]["flags"]["optimization_level"])
        step = row(rec, "step_time_s")
        out[level] = Measured(
            max(row(rec, "process_peak_bytes")["features_per_rank"]), reference * step["ratio"], (rec["name"],)
        )
    return out


def cases() -> list[FitCase]:
    from mindspeed_like.plan import features, host_kernels, megatron_code
    from mindspeed_like.plan.accuracy import measured_with_bf16_units
    from mindspeed_like.plan.compare_args import run_from_compare
    from mindspeed_like.plan.fit import fit

    out = []
    for recs in grouped().values():
        options = dict(recs[0]["options"])
        levels = measured_levels(recs)
        others = [m.peak for level, m in levels.items() if level > 0]
        if max(others) >= levels[0].peak:
            continue  # no budget below megatron's peak fits the other levels
        # below megatron's peak, above every other level's with room for the fit's headroom
        budget = min(0.97 * levels[0].peak, max(others) / (1 - DEFAULT_HEADROOM) * 1.01)
        if budget <= max(others):
            continue  # the levels' peaks lie within a few % of megatron's: no budget separates them
        args = argparse.Namespace(**options)
        command = ["--preset", options["preset"]] + _size_tokens(options)
        run = run_from_compare(args, {}, recs[0]["host"].get("device", "cpu"), command=command)
        with host_kernels.measured_on(measured_with_bf16_units(recs[0])), megatron_code.as_measured_by(recs[0]):
            result = fit(run, features.resolve(values={"optimization_level": 2}), int(budget), None)
        chosen = result.best or result.leanest
        label = f"{options['preset']} {options['num_layers']}L h{options['hidden_size']} s{options['seq_length']}"
        out.append(
            FitCase(
                label=f"{label}, {run_text(recs[0])}",
                options=options,
                levels=levels,
                budget=budget,
                recommended=chosen.level,
                predicted_peak=chosen.peak,
                command=result.command,
            )
        )
    return out


def _size_tokens(options: dict[str, Any]) -> list[str]:
    tokens = []
    for key in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "seq_length",
        "micro_batch_size",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "num_layers_per_virtual_pipeline_stage",
        "context_parallel_size",
        "data_parallel_size",
        "expert_model_parallel_size",
        "transformer_impl",
    ):
        value = options.get(key)
        if value is not None:
            tokens += ["--" + key.replace("_", "-"), str(value)]
    for key in ("sequence_parallel", "use_distributed_optimizer"):
        if options.get(key):
            tokens.append("--" + key.replace("_", "-"))
    return tokens


def row_of(case: FitCase) -> dict[str, Any]:
    mib = 2**20
    ratio = case.time_vs_best
    return {
        "table": TABLE,
        "case": case.label,
        "budget_MiB": case.budget / mib,
        "megatron_peak_MiB": case.levels[0].peak / mib,
        "recommended_level": case.recommended,
        "predicted_peak_MiB": case.predicted_peak / mib,
        "measured_peak_MiB": case.levels[case.recommended].peak / mib if case.recommended in case.levels else None,
        "peak_within_budget": case.peak_ok,
        "levels_measured": ", ".join(str(level) for level in sorted(case.levels)),
        "time_vs_best_fitting": ratio,
        "verdict": "met" if case.ok else "missed",
        "command": case.command,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_like.plan.fit_check", description=__doc__)
    parser.add_argument("--record", action="store_true", help=f"write results/{RECORD}.json")
    args = parser.parse_args(argv)
    from mindspeed_like.run_arguments import quiet_expected_warnings

    quiet_expected_warnings()
    found = cases()
    rows = [row_of(c) for c in found]
    print(
        *records.format_table(
            "plan --fit against measurement",
            [{k: v for k, v in r.items() if k not in ("table", "command")} for r in rows],
        ),
        sep="\n",
    )
    met = sum(c.ok for c in found)
    tolerance = f"{100 * TIME_TOLERANCE:.0f}%"
    print(
        f"\n{met} of {len(found)} cases met (peak within the budget, step time within {tolerance} of the best "
        "fitting level)"
    )
    if args.record:
        rec = records.Record(RECORD, command=["python", "-m", "mindspeed_like.plan.fit_check", "--record"])
        for row in rows:
            rec.add_row(**row)
        rec.extra.update(met=met, cases=len(found), time_tolerance_pct=100 * TIME_TOLERANCE)
        print("wrote", rec.write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
