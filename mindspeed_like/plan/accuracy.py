"""The plan checked against measurement: every CPU `mindspeed-like compare` record in results/,
predicted from its own options and compared metric by metric, with Megatron-LM's
``report_theoretical_memory`` beside it.

    python -m mindspeed_like.plan.accuracy            # the table
    python -m mindspeed_like.plan.accuracy --record   # also results/plan-accuracy.json (docs/plan.md renders it)

Compared as compare reports them: per rank, the largest rank of each arm. Model state and
activations are exact byte counts (storages); the process peak is the OS's peak RSS on a CPU host.
One kind of bytes is compared as measured, and the table says where:

- expert parallel: a rank's experts get the rows its router sends, which the plan cannot know; the
  plan's balanced split is compared with the mean over the ranks, and the largest rank with the
  plan's bound for it (``predict.routed_rows_bound``: dropless routing's worst case), which it must
  not exceed.

Every byte the plan counts is compared: compare's optimizer meter walks the optimizer's object graph
(reuse-fp32-param's int16 residual shard under the distributed optimizer included, issue 49 item 4).

The baseline records (``compare-plan-baseline*``) calibrate the CPU process runtime and are left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mindspeed_like.plan import host_kernels, megatron_code
from mindspeed_like.plan.peak import BASELINE_RECORDS
from mindspeed_like.toolkit import records

RECORD = "plan-accuracy"
TABLE = "plan_accuracy"
STATE_METRICS = ("weights_bytes", "gradients_bytes", "optimizer_bytes", "model_state_bytes")
METRICS = (*STATE_METRICS, "activations_bytes", "process_peak_bytes")
# the targets of issue 38, as fractions
TARGETS = {"model_state_bytes": 0.02, "activations_bytes": 0.10, "process_peak_bytes": 0.10}


@dataclass(frozen=True)
class Case:
    record: str
    arm: str
    layout: str
    measured: dict[str, float]
    predicted: dict[str, float]
    theory: dict[str, float] | None
    notes: tuple[str, ...]
    # expert parallelism: the largest rank's measured activations and the plan's bound for it
    largest_rank: float | None = None
    largest_rank_bound: float | None = None

    @property
    def within_bound(self) -> bool | None:
        if self.largest_rank is None or self.largest_rank_bound is None:
            return None
        return self.largest_rank <= self.largest_rank_bound

    def error(self, metric: str) -> float:
        return self.predicted[metric] / self.measured[metric] - 1

    def theory_error(self, metric: str) -> float | None:
        if self.theory is None or metric not in self.theory:
            return None
        return self.theory[metric] / self.measured[metric] - 1


def compare_records(folder: Path | None = None, device: str = "cpu") -> list[Path]:
    """The compare records of ``device`` (``cpu``: the CPU ones; ``cuda``: ``*-cuda``), calibration
    records left out."""
    folder = folder or records.results_dir()
    skip = set(BASELINE_RECORDS.values())
    out = []
    for path in sorted(folder.glob("compare-*.json")):
        if path.stem in skip:
            continue
        on_accelerator = records.is_accelerator_record(path.stem)
        if (device == "cpu" and not on_accelerator) or (device != "cpu" and path.stem.endswith(f"-{device}")):
            out.append(path)
    return out


def layout_text(options: dict[str, Any]) -> str:
    parts = []
    for key, label in (
        ("tensor_model_parallel_size", "TP"),
        ("pipeline_model_parallel_size", "PP"),
        ("context_parallel_size", "CP"),
        ("data_parallel_size", "DP"),
        ("expert_model_parallel_size", "EP"),
    ):
        if options.get(key, 1) > 1:
            parts.append(f"{label}{options[key]}")
    if options.get("sequence_parallel"):
        parts.append("SP")
    if options.get("num_layers_per_virtual_pipeline_stage"):
        parts.append("VPP")
    if options.get("use_distributed_optimizer"):
        parts.append("distopt")
    if options.get("use_torch_fsdp2"):
        parts.append("FSDP2" + (" no-reshard" if options.get("torch_fsdp2_no_reshard_after_forward") else ""))
    if options.get("use_megatron_fsdp"):
        parts.append(f"Megatron-FSDP {options.get('data_parallel_sharding_strategy')}")
        instances = options.get("num_distributed_optimizer_instances", 1)
        if instances > 1:
            parts.append(f"HSDP{instances}")
            if options.get("outer_dp_sharding_strategy", "no_shard") != "no_shard":
                parts.append(f"outer {options['outer_dp_sharding_strategy']}")
        for field, what, default in (
            ("megatron_fsdp_main_params_dtype", "main params", "fp32"),
            ("megatron_fsdp_main_grads_dtype", "main grads", "auto"),
        ):
            if options.get(field, default) != default:
                parts.append(f"{what} {options[field]}")
    if options.get("transformer_impl") == "local":
        parts.append("local spec")
    return " ".join(parts) or "1 rank"


def measured_with_bf16_units(record: dict[str, Any]) -> bool:
    """Whether the record's host ran bf16 GEMMs natively (compare writes it; the records before it
    were all measured on one AVX512-BF16 host)."""
    return bool(record["host"].get("cpu_bf16_gemm", True))


def run_text(record: dict[str, Any]) -> str:
    """How a compare record ran, after its model size in a case's label: the layout, fp32 where
    it did not train in bf16, and the host where it was not the bf16-GEMM one (:func:`host_text`)."""
    options = record["options"]
    return f"{layout_text(options)}{', fp32' if options.get('fp32') else ''}{host_text(record)}"


def host_text(record: dict[str, Any]) -> str:
    """``""``, or what sets a CPU record's host apart from the bf16-GEMM one most records ran on:
    the ISA torch ran at where bf16 GEMMs ran in fp32 (an AVX2 host, or one held to AVX2)."""
    if record["host"].get("device", "cpu") != "cpu" or measured_with_bf16_units(record):
        return ""
    isa = (record["host"].get("cpu_isa") or {}).get("aten_cpu_capability", "no bf16 units")
    return f", {isa}"


def cases_of(path: Path) -> list[Case]:
    """Both arms of one compare record, predicted from the record's own options."""
    from mindspeed_like.plan import features, theory
    from mindspeed_like.plan.compare_args import run_from_compare
    from mindspeed_like.plan.predict import predict

    rec = records.read(path)
    options = dict(rec["options"])
    args = argparse.Namespace(**options)
    flags = options.get("flags") or {}
    switches = features.resolve(values=flags)
    run = run_from_compare(args, flags, rec["host"].get("device", "cpu"))
    with host_kernels.measured_on(measured_with_bf16_units(rec)), megatron_code.as_measured_by(rec):
        pred = predict(run, switches.paths(run), switches.enabled)
    rows = {row["metric"]: row for row in rec["rows"] if "metric" in row}
    theory_figures = theory.report(run) if run.layout.pp == 1 else None
    # a CPU peak carries the process runtime, calibrated by eager baselines; an accelerator's is its allocator's
    compiled = rec["host"].get("torchdynamo_disable") != "1" and run.device == "cpu"
    size = (
        f"{options['num_layers']}L h{options['hidden_size']} s{options['seq_length']} mbs{options['micro_batch_size']}"
    )
    out = []
    for arm in pred.arms():
        per_stage = run.layout.world_size // run.layout.pp
        measured, predicted, notes = {}, {}, []
        largest = bound = None
        for metric in METRICS:
            values = rows[metric][f"{arm.name}_per_rank"]
            mine = [arm.stages[r // per_stage].metrics()[metric] for r in range(len(values))]
            if metric == "activations_bytes" and run.layout.ep > 1:
                measured[metric] = statistics.fmean(values)
                largest = max(values)
                bound = max(s.activations_largest_rank_bound or 0 for s in arm.stages)
                notes.append(
                    f"EP: activations vs the mean over ranks (largest rank {largest / 2**20:.1f} MiB, the plan's "
                    f"bound for it {bound / 2**20:.1f} MiB: {'within' if largest <= bound else 'OVER'})"
                )
            else:
                measured[metric] = max(values)
            predicted[metric] = max(mine)
        if compiled:
            notes.append(
                "torch.compile on: its process runtime is not the eager baselines' (peak not held to the target)"
            )
        theory_arm = None
        if theory_figures is not None and arm.name == "megatron":
            theory_arm = {k: theory_figures[k] for k in ("model_state_bytes", "activations_bytes")}
        label = f"{options['preset']} {size}, {run_text(rec)}"
        if arm.name == "features":
            level = flags.get("optimization_level")
            label += f", level {level}" if level is not None else ", " + ", ".join(sorted(flags))
            if level is not None and flags.get("fsdp2_config_path"):
                from mindspeed_like.features.fsdp2_config.options import load

                label += f", fsdp2-config {' '.join(sorted(load(flags['fsdp2_config_path']).given))}"
        out.append(Case(path.stem, arm.name, label, measured, predicted, theory_arm, tuple(notes), largest, bound))
    return out


def all_cases(folder: Path | None = None, device: str = "cpu") -> list[Case]:
    return [case for path in compare_records(folder, device) for case in cases_of(path)]


def row_of(case: Case) -> dict[str, Any]:
    row: dict[str, Any] = {"table": TABLE, "record": case.record, "arm": case.arm, "case": case.layout}
    for metric in METRICS:
        short = metric.removesuffix("_bytes")
        row[f"measured_{short}"] = case.measured[metric]
        row[f"predicted_{short}"] = case.predicted[metric]
        row[f"error_{short}_pct"] = 100 * case.error(metric)
    for metric in ("model_state_bytes", "activations_bytes"):
        err = case.theory_error(metric)
        row[f"theory_error_{metric.removesuffix('_bytes')}_pct"] = None if err is None else 100 * err
    row["measured_activations_largest_rank"] = case.largest_rank
    row["predicted_activations_largest_rank_bound"] = case.largest_rank_bound
    if case.largest_rank is not None and case.largest_rank_bound is not None:  # docs/plan.md quotes these
        row["predicted_activations_MiB"] = case.predicted["activations_bytes"] / 2**20
        row["measured_activations_largest_rank_MiB"] = case.largest_rank / 2**20
        row["predicted_activations_largest_rank_bound_MiB"] = case.largest_rank_bound / 2**20
    row["notes"] = "; ".join(case.notes)
    return row


def held(case: Case, metric: str) -> bool:
    """Whether the target applies: a run with torch.compile on has another process runtime than the
    eager baseline records the CPU peak is calibrated by."""
    return not (metric == "process_peak_bytes" and any(n.startswith("torch.compile on") for n in case.notes))


def missed(case: Case) -> list[str]:
    """The targets this case misses, as text."""
    out = []
    for metric, bound in TARGETS.items():
        if not held(case, metric):
            continue
        err = case.error(metric)
        if abs(err) > bound:
            out.append(f"{case.record} {case.arm} {metric}: {100 * err:+.2f}% (target +-{100 * bound:.0f}%)")
    return out


def table(cases: Sequence[Case]) -> list[str]:
    header = (
        f"{'case':58s} {'arm':9s} {'state':>7s} {'activ':>7s} {'peak':>7s} | {'theory state':>12s} {'theory act':>10s}"
    )
    lines = [header, "-" * len(header)]
    for case in cases:
        t_state, t_act = case.theory_error("model_state_bytes"), case.theory_error("activations_bytes")
        lines.append(
            f"{case.layout[:58]:58s} {case.arm:9s} {100 * case.error('model_state_bytes'):+6.2f}% "
            f"{100 * case.error('activations_bytes'):+6.2f}% {100 * case.error('process_peak_bytes'):+6.2f}% | "
            f"{_pct(t_state):>12s} {_pct(t_act):>10s}"
        )
    return lines


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _previous_theory(path: Path) -> dict[tuple[str, str], dict[str, float]]:
    """The report_theoretical_memory errors of the record being replaced, by (record, arm)."""
    if not path.exists():
        return {}
    out = {}
    for row in records.read(path)["rows"]:
        kept = {k: v for k, v in row.items() if k.startswith("theory_") and v is not None}
        if kept:
            out[(row["record"], row["arm"])] = kept
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mindspeed_like.plan.accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--record", action="store_true", help=f"write results/{RECORD}.json (-<device> on an accelerator)"
    )
    parser.add_argument("--device", default="cpu", help="whose compare records: cpu (default), cuda (the *-cuda ones)")
    args = parser.parse_args(argv)
    from mindspeed_like.run_arguments import quiet_expected_warnings

    quiet_expected_warnings()
    cases = all_cases(device=args.device)
    print("\n".join(table(cases)))
    misses = [m for case in cases for m in missed(case)]
    print(f"\n{len(cases)} cases; targets missed: {len(misses)}")
    for m in misses:
        print("  " + m)
    if args.record:
        name = records.device_record_name(RECORD, args.device)
        previous = _previous_theory(records.results_dir() / f"{name}.json")
        rec = records.Record(
            name, command=["python", "-m", "mindspeed_like.plan.accuracy", "--record", "--device", args.device]
        )
        for case in cases:
            row = row_of(case)
            for key, value in previous.get((case.record, case.arm), {}).items():
                if row.get(key) is None:
                    row[key] = value  # Megatron-LM not at hand: its figures are a function of the options
            rec.add_row(**row)
        rec.extra["targets_pct"] = {k: 100 * v for k, v in TARGETS.items()}
        rec.extra["records"] = sorted({case.record for case in cases})
        peak = "process_peak_bytes"
        held_peak = [case for case in cases if held(case, peak)]
        rec.extra["peak_held"] = len(held_peak)
        rec.extra["peak_misses"] = sum(abs(case.error(peak)) > TARGETS[peak] for case in held_peak)
        print("wrote", rec.write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
