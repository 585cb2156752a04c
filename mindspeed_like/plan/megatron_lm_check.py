"""The plan checked against Megatron-LM's own runs on a CPU host (issue 38, "and of Megatron-LM's own
runs"): ``pretrain_gpt.py`` through ``torchrun -m mindspeed_like.run`` for a few command lines, each
rank's peak as Megatron-LM itself prints it, against ``mindspeed-like plan`` on the same arguments.

    MEGATRON_LM_PATH=/path/to/Megatron-LM python -m mindspeed_like.plan.megatron_lm_check --measure --repeats 3
        # runs them (each 3 times, the median kept): results/megatron-lm-memory.json
    python -m mindspeed_like.plan.megatron_lm_check --record
        # the plan against that record now: results/plan-megatron-lm.json (make docs; docs/plan.md)

What is measured: Megatron-LM's ``report_memory`` line after the last logged iteration (``[Rank r]
(after 2 iterations) memory (MB) | ... | max allocated: X``; :data:`ITERATIONS`), printed by every rank
of data-parallel rank 0. On a CPU host the cpu-training-loop answers ``torch.cuda.max_memory_allocated``
with the process's peak resident set, so X is the rank's process peak over two whole steps (the
optimizer's moments created in the first). A run with ``--optimization-level`` is the
features arm, one without it megatron's own path (the import line alone switches no acceleration on).

The process runtime of a Megatron-LM rank (Python, torch, megatron.training, its data pipeline) is
not compare's, so it is calibrated the same way from the smallest run here (:data:`BASELINE`, a
hidden-64 model): its measured peak less what the plan says its tensors held, per arm. Megatron-LM
builds the model in its parameter dtype on the host (``--bf16``: no fp32 copy), so no build term.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

from mindspeed_like.plan import megatron_code
from mindspeed_like.plan.peak import MEGATRON_LM_MEMORY_RECORD
from mindspeed_like.toolkit import records

RECORD = "plan-megatron-lm"  # the table: measured against predicted (make docs refreshes it)
MEASURED = MEGATRON_LM_MEMORY_RECORD  # what Megatron-LM printed (only --measure, with Megatron-LM, writes it)
TABLE = "plan_megatron_lm"
TARGET = 0.10  # issue 38: the process peak within 10%
ITERATIONS = 2
MEMORY_LINE = re.compile(r"\[Rank (\d+)\] \(after \d+ iterations\) memory \(MB\) \|.*?max allocated: ([0-9.]+)")
_LLAMA = (
    "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --bf16 --attention-dropout 0.1 --hidden-dropout 0.1"
)
# the smallest run: calibrates the runtime of a Megatron-LM rank (name, processes, arguments)
BASELINE = ("baseline", 1, f"--num-layers 1 --hidden-size 64 --num-attention-heads 4 --seq-length 64 {_LLAMA}")
_SIZE = "--num-layers 4 --hidden-size 512 --num-attention-heads 8 --group-query-attention --num-query-groups 2"
_GPT = "--num-layers 4 --hidden-size 512 --num-attention-heads 8"
CASES: tuple[tuple[str, int, str], ...] = (
    ("llama s1024, 1 rank", 1, f"{_SIZE} --seq-length 1024 {_LLAMA}"),
    ("llama s1024, 1 rank, level 1", 1, f"{_SIZE} --seq-length 1024 {_LLAMA} --optimization-level 1"),
    ("llama s1024, 1 rank, level 2", 1, f"{_SIZE} --seq-length 1024 {_LLAMA} --optimization-level 2"),
    # the levels with glibc's allocator as it is: what host-allocator's retained heap adds (docs/plan.md)
    (
        "llama s1024, 1 rank, level 1, no host-allocator",
        1,
        f"{_SIZE} --seq-length 1024 {_LLAMA} --optimization-level 1 --no-tune-host-allocator",
    ),
    (
        "llama s1024, 1 rank, level 2, no host-allocator",
        1,
        f"{_SIZE} --seq-length 1024 {_LLAMA} --optimization-level 2 --no-tune-host-allocator",
    ),
    (
        "llama s1024, TP2 SP",
        2,
        f"{_SIZE} --seq-length 1024 {_LLAMA} --tensor-model-parallel-size 2 --sequence-parallel",
    ),
    ("llama s512, PP2", 2, f"{_SIZE} --seq-length 512 {_LLAMA} --pipeline-model-parallel-size 2"),
    (
        "llama s512, DP2 distopt, level 2",
        2,
        f"{_SIZE} --seq-length 512 {_LLAMA} --use-distributed-optimizer --optimization-level 2",
    ),
    ("llama s1024, 1 rank, selective recompute", 1, f"{_SIZE} --seq-length 1024 {_LLAMA} --recompute-activations"),
    # Megatron-LM's defaults for the rest: LayerNorm, GELU, learned positions, tied embeddings, biases
    ("gpt s1024, fp32", 1, f"{_GPT} --seq-length 1024"),
    ("gpt s1024, bf16", 1, f"{_GPT} --seq-length 1024 --bf16"),
    ("gpt s1024, bf16, level 1", 1, f"{_GPT} --seq-length 1024 --bf16 --optimization-level 1"),
    ("gpt s512, bf16, DP2", 2, f"{_GPT} --seq-length 512 --bf16"),
)
# beside each case's own (the whole model): the tiny run's data and schedule (megatron_lm.TINY_SCHEDULE)
_COMMON = "--vocab-size 32000 --micro-batch-size 1 --global-batch-size 2 --max-position-embeddings 1024"


def arguments(case: tuple[str, int, str]) -> list[str]:
    """A case's pretrain_gpt.py arguments beside megatron_lm.TINY_SCHEDULE's (the later value wins)."""
    return [*_COMMON.split(), *case[2].split(), "--train-iters", str(ITERATIONS)]


def measure(case: tuple[str, int, str]) -> dict[int, int]:
    """rank -> the peak bytes Megatron-LM printed for it (every rank of data-parallel rank 0)."""
    from mindspeed_like.workloads import megatron_lm

    output = megatron_lm.torchrun_output(
        case[1], megatron_lm.launcher(), arguments(case), base=megatron_lm.TINY_SCHEDULE
    )
    # the last line of each rank wins: the peak over every iteration
    found = {int(rank): int(float(mib) * 2**20) for rank, mib in MEMORY_LINE.findall(output)}
    if not found:
        raise AssertionError(f"{case[0]}: no memory line in Megatron-LM's output:\n{output[-3000:]}")
    return found


def _plan(args: Sequence[str], processes: int):
    """The plan's prediction of a pretrain_gpt.py run as the CLI makes it (built-in parser: Megatron-LM
    need not be importable), on a CPU host."""
    from mindspeed_like.plan import cli
    from mindspeed_like.workloads.megatron_lm import TINY_SCHEDULE

    argv = [*TINY_SCHEDULE, *args, "--world-size", str(processes), "--target-device", "cpu", "--parser", "builtin"]
    return cli.predict_argv(argv)


def predicted(case: tuple[str, int, str]) -> dict[int, int]:
    """rank -> the plan's process peak (the features arm where the case sets a level)."""
    with megatron_code.as_measured_in(MEASURED):
        prediction = _plan(arguments(case), case[1])
    arm = prediction.features if "--optimization-level" in case[2] else prediction.megatron
    per_stage = case[1] // len(arm.stages)
    return {rank: arm.stages[rank // per_stage].peak.total for rank in range(case[1])}


def reporting_ranks(case: tuple[str, int, str]) -> list[int]:
    """The ranks whose memory Megatron-LM prints: those of data-parallel rank 0 (``report_memory``),
    in megatron's default rank order (tp, cp, ep, dp, pp: tp fastest; EP shares the DP ranks)."""
    lay = _plan(arguments(case), case[1]).run.layout
    inner = lay.tp * lay.cp
    return [rank for rank in range(case[1]) if (rank // inner) % lay.dp == 0]


def held_by_tensors(args: Sequence[str], processes: int) -> dict[str, int]:
    """arm -> what the plan says rank 0's tensors held at the peak, runtime left out: the calibration
    of :func:`mindspeed_like.plan.peak.megatron_lm_runtime_bytes` (the features arm at level 2, as a
    command line without a level is planned)."""
    from mindspeed_like.plan import peak

    peak.calibrating.append(True)
    try:
        with megatron_code.as_measured_in(MEASURED):
            prediction = _plan(args, processes)
    finally:
        peak.calibrating.pop()
    return {arm.name: arm.stages[0].peak.total for arm in prediction.arms()}


def calibrate(path) -> None:
    """Refresh the baseline's ``held`` (the plan's, as it predicts now) in the measurement record, so
    the runtime that :mod:`~mindspeed_like.plan.peak` reads from it follows the model."""
    from mindspeed_like.plan import peak

    data = records.read(path)
    baseline = data["extra"]["baseline"]
    baseline["held"] = held_by_tensors(baseline["arguments"], 1)
    path.write_text(json.dumps(data, indent=1) + "\n")
    peak.megatron_lm_runtime_bytes.cache_clear()


Samples = dict[str, dict[str, list[int]]]  # case -> rank -> each run's peak bytes


def rows(measured: dict[str, dict[str, int]], samples: Samples | None = None) -> list[dict[str, Any]]:
    """The table: every measured rank of every case (the median of its runs, each run listed)
    against the plan's prediction now."""
    out = []
    samples = samples or {}
    for case in CASES:
        plan = predicted(case)
        for rank, bytes_ in sorted((int(r), b) for r, b in measured[case[0]].items()):
            out.append(
                {
                    "table": TABLE,
                    "case": case[0],
                    "rank": rank,
                    "measured_MiB": bytes_ / 2**20,
                    "predicted_MiB": plan[rank] / 2**20,
                    "error_pct": (plan[rank] / bytes_ - 1) * 100,
                    "runs_MiB": " / ".join(f"{b / 2**20:,.0f}" for b in samples.get(case[0], {}).get(str(rank), [])),
                    "command": " ".join(arguments(case)),
                }
            )
    return out


def measure_all(repeats: int = 1) -> None:
    """Run every case and the baseline (both arms) with Megatron-LM, each ``repeats`` times in turn
    (a case's runs spread over the batch): the median peak of each rank, and every run's, in
    results/MEASURED.json. A CPU rank's peak moves between identical runs (glibc's heap: with
    host-allocator on, by up to a fifth), so one run is a sample, not the figure."""
    import statistics

    baseline_level2 = (BASELINE[0], BASELINE[1], BASELINE[2] + " --optimization-level 2")
    runs = [*CASES, BASELINE, baseline_level2]
    samples: dict[int, dict[int, list[int]]] = {i: {} for i in range(len(runs))}
    for _ in range(repeats):
        for i, case in enumerate(runs):
            for rank, peak in measure(case).items():
                samples[i].setdefault(rank, []).append(peak)

    def medians(i: int) -> dict[str, int]:
        return {str(r): int(statistics.median(v)) for r, v in samples[i].items()}

    measured = {case[0]: medians(i) for i, case in enumerate(CASES)}
    peaks = {"megatron": medians(len(CASES))["0"], "features": medians(len(CASES) + 1)["0"]}
    command = ["python", "-m", "mindspeed_like.plan.megatron_lm_check", "--measure", "--repeats", str(repeats)]
    record = records.Record(MEASURED, command=command)
    record.extra.update(
        baseline={"arguments": arguments(BASELINE), "peak": peaks},
        measured=measured,
        repeats=repeats,
        samples={case[0]: {str(r): v for r, v in samples[i].items()} for i, case in enumerate(CASES)},
    )
    print(f"wrote {record.write()}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_like.plan.megatron_lm_check", description=__doc__)
    parser.add_argument("--measure", action="store_true", help=f"run Megatron-LM (MEGATRON_LM_PATH): {MEASURED}.json")
    parser.add_argument("--record", action="store_true", help=f"write results/{RECORD}.json (docs/plan.md)")
    parser.add_argument("--repeats", type=int, default=1, help="with --measure: runs of each case (the median kept)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be 1 or more, got {args.repeats}")
    if args.measure:
        from mindspeed_like.workloads import megatron_lm

        if not megatron_lm.available():
            print(megatron_lm.SKIP_REASON, file=sys.stderr)
            return 2
        measure_all(args.repeats)
    path = records.results_dir() / f"{MEASURED}.json"
    if not path.exists():
        print(f"no {path}: run with --measure and MEGATRON_LM_PATH set first", file=sys.stderr)
        return 2
    calibrate(path)
    record = records.Record(RECORD, command=["python", "-m", "mindspeed_like.plan.megatron_lm_check", "--record"])
    extra = records.read(path)["extra"]
    table_out(record, rows(extra["measured"], extra.get("samples")), "CPU", "ranks", write=args.record)
    return 0


def table_out(record: records.Record, table: Sequence[dict[str, Any]], where: str, counted: str, write: bool) -> None:
    """The rows into ``record``, how many are within :data:`TARGET` (``extra.within`` of
    ``extra.<counted>``), printed; written with ``write``."""
    for row in table:
        record.add_row(**row)
    within = [row for row in record.rows if abs(row["error_pct"]) <= 100 * TARGET]
    record.extra.update({counted: len(record.rows), "within": len(within)})
    print(*records.format_table(f"plan against Megatron-LM's own runs ({where})", record.rows), sep="\n")
    if write:
        print(f"wrote {record.write()}")


if __name__ == "__main__":
    sys.exit(main())
