"""The plan checked against Megatron-LM's own runs on one GPU (issue 38: "on a GPU, where one is at
hand, ``torch.cuda.max_memory_allocated``"): ``pretrain_gpt.py`` as a user runs it, megatron's own
path with plain ``torchrun pretrain_gpt.py`` and the features through ``torchrun -m mindspeed_like.run``,
each rank's peak as Megatron-LM itself prints it, against ``mindspeed-like plan --target-device cuda``
on the same arguments.

    # on the GPU machine (MEGATRON_LM_PATH: a core_v0.16.1 checkout; benchmarks/gpu/machine.sh sets it)
    python3 -m mindspeed_like.plan.megatron_lm_device_check --measure --jobs 3 --logs /tmp/logs
        # results/megatron-lm-memory-cuda.json
    # here, from that record
    python -m mindspeed_like.plan.megatron_lm_device_check --record   # results/plan-megatron-lm-cuda.json

What is measured: Megatron-LM's ``report_memory`` line after the last iteration (``max allocated``,
i.e. ``torch.cuda.max_memory_allocated`` over the build and two whole steps; the optimizer's moments
are created in the first), printed by every rank of data-parallel rank 0, and its
``report_theoretical_memory`` line (megatron's own estimate, printed beside it on rank 0).

The runs only measure memory, so they may share the GPU (``--jobs``): each process's
``max_memory_allocated`` is its own allocator's. Dropout is megatron's default (0.1) as a user runs it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mindspeed_like.plan import megatron_code
from mindspeed_like.plan.megatron_lm_check import MEMORY_LINE, table_out
from mindspeed_like.toolkit import records

DEVICE = "cuda"
MEASURED = records.device_record_name("megatron-lm-memory", DEVICE)
RECORD = records.device_record_name("plan-megatron-lm", DEVICE)
TABLE = "plan_megatron_lm_cuda"
ITERATIONS = 2
THEORY_LINE = re.compile(
    r"Theoretical memory footprints: weight and optimizer=([0-9.]+) MB(?:, activation=([0-9.]+) MB)?"
)

_DATA = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --micro-batch-size 1 --global-batch-size 2 "
    f"--train-iters {ITERATIONS} --lr 1e-4 --log-interval 1 --eval-iters 0 --eval-interval 1000 --seed 1234"
)
_LLAMA = (
    "--num-layers 4 --hidden-size 2048 --num-attention-heads 16 --group-query-attention --num-query-groups 4 "
    "--seq-length 4096 --max-position-embeddings 4096 --normalization RMSNorm --swiglu "
    "--position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --bf16"
)
# what megatron's own path needs on a GPU without TransformerEngine and apex (docs/megatron-lm.md);
# the same for both arms, so they differ by the features alone
_NO_TE = (
    "--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-rope-fusion "
    "--no-persist-layer-norm"
)
_MOE = (
    "--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 1408 --moe-token-dispatcher-type alltoall "
    "--moe-aux-loss-coeff 0.01"
)
LEVEL = "--optimization-level"
CASES: tuple[tuple[str, str], ...] = (
    ("llama s4096", _LLAMA),
    ("llama s4096, level 1", f"{_LLAMA} {LEVEL} 1"),
    ("llama s4096, level 2", f"{_LLAMA} {LEVEL} 2"),
    ("llama s4096, selective recompute", f"{_LLAMA} --recompute-activations"),
    (
        "llama s4096, level 1, full recompute 2 layers",
        f"{_LLAMA} {LEVEL} 1 --recompute-granularity full --recompute-method block --recompute-num-layers 2",
    ),
    ("llama s4096, distributed optimizer", f"{_LLAMA} --use-distributed-optimizer"),
    ("moe 8 experts s4096", f"{_LLAMA} {_MOE}"),
    ("moe 8 experts s4096, level 1", f"{_LLAMA} {_MOE} {LEVEL} 1"),
)


# megatron's own path that cannot start on a GPU without TransformerEngine: run with the import line
# and no level (megatron's path with the library's fixes only). MoE's router GEMM reads
# ``te_general_gemm``, a name megatron-core 0.16 defines only when TE imports (NameError at the first
# forward, seen on the H200; fixes/moe_router_without_te.py)
NEEDS_FIXES = frozenset({"moe 8 experts s4096"})


def arguments(case: tuple[str, str]) -> list[str]:
    return [*_DATA.split(), *case[1].split(), *_NO_TE.split()]


def command(case: tuple[str, str], megatron_lm: str, port: int) -> list[str]:
    """megatron's own path: plain ``pretrain_gpt.py``; a case with a level: the one import line first."""
    script = os.path.join(megatron_lm, "pretrain_gpt.py")
    runner = ["-m", "mindspeed_like.run", script] if LEVEL in case[1] or case[0] in NEEDS_FIXES else [script]
    launch = ["-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(port)]
    return [sys.executable, *launch, *runner, *arguments(case)]


def parse(output: str) -> dict[str, Any]:
    """rank -> peak bytes (the last memory line of each rank wins) and megatron's own estimate."""
    peaks = {rank: int(float(mib) * 2**20) for rank, mib in MEMORY_LINE.findall(output)}
    theory = THEORY_LINE.findall(output)
    found: dict[str, Any] = {"peaks": peaks}
    if theory:
        state, activations = theory[-1]
        found["theory_MiB"] = {"state": float(state), "activations": float(activations) if activations else None}
    return found


def measure_all(jobs: int, logs: Path | None, timeout: float, only: str = "") -> dict[str, dict[str, Any]]:
    """Every case (whose name contains ``only``), ``jobs`` at a time on the one GPU; a case that
    fails keeps its output's tail."""
    megatron_lm = os.environ.get("MEGATRON_LM_PATH", "")
    if not os.path.isfile(os.path.join(megatron_lm, "pretrain_gpt.py")):
        raise SystemExit("set MEGATRON_LM_PATH to a Megatron-LM checkout (core_v0.16.1)")
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_LIKE_ARGS"}
    pending = [(i, case) for i, case in enumerate(CASES) if only in case[0]]
    running: dict[int, tuple[subprocess.Popen, float, Path]] = {}
    results: dict[str, dict[str, Any]] = {}
    folder = logs or Path(os.environ.get("TMPDIR", "/tmp")) / "megatron-lm-device-check"
    folder.mkdir(parents=True, exist_ok=True)
    while pending or running:
        while pending and len(running) < jobs:
            i, case = pending.pop(0)
            log = folder / f"case{i}.log"
            with log.open("w") as out:
                process = subprocess.Popen(
                    command(case, megatron_lm, 29600 + i), stdout=out, stderr=subprocess.STDOUT, env=env
                )
            running[i] = (process, time.monotonic(), log)
        time.sleep(1)
        for i, (process, started, log) in list(running.items()):
            overdue = time.monotonic() - started > timeout
            if process.poll() is None and not overdue:
                continue
            if overdue:
                process.kill()
                process.wait()
            del running[i]
            output = log.read_text(errors="replace")
            found = parse(output)
            found.update(rc=process.returncode, seconds=round(time.monotonic() - started, 1))
            if not found["peaks"]:
                found["tail"] = output[-3000:]
            results[CASES[i][0]] = found
            print(f"{CASES[i][0]}: rc {process.returncode}, {found['seconds']} s, peaks {found['peaks']}", flush=True)
    return results


def predicted(case: tuple[str, str]) -> tuple[int, dict[str, int]]:
    """The plan's peak on the device for the case's arm (features where it sets a level), and its
    model state / activations (for the table)."""
    from mindspeed_like.plan import cli

    argv = [*arguments(case), "--world-size", "1", "--target-device", DEVICE, "--parser", "builtin"]
    with megatron_code.as_measured_in(MEASURED):
        prediction = cli.predict_argv(argv)
    arm = prediction.features if LEVEL in case[1] else prediction.megatron
    stage = arm.stages[0]
    return stage.peak.total, {"model_state": stage.peak.model_state, "activations": stage.peak.activations}


def rows(measured: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for case in CASES:
        found = measured.get(case[0])
        if not found or not found.get("peaks"):
            continue
        peak, parts = predicted(case)
        bytes_ = found["peaks"]["0"]  # one rank; parse() keys ranks as printed
        theory = found.get("theory_MiB") or {}
        theory_total = theory["state"] + theory["activations"] if theory.get("activations") is not None else None
        out.append(
            {
                "table": TABLE,
                "case": case[0],
                "measured_MiB": bytes_ / 2**20,
                "predicted_MiB": peak / 2**20,
                "error_pct": (peak / bytes_ - 1) * 100,
                "plan_state_MiB": parts["model_state"] / 2**20,
                "plan_activations_MiB": parts["activations"] / 2**20,
                "megatron_theory_MiB": theory_total if theory_total is not None else theory.get("state"),
                "megatron_theory_is": "state + activations" if theory_total is not None else "state only",
                "command": " ".join(arguments(case)),
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mindspeed_like.plan.megatron_lm_device_check", description=__doc__)
    parser.add_argument("--measure", action="store_true", help=f"run Megatron-LM on the GPU: results/{MEASURED}.json")
    parser.add_argument("--record", action="store_true", help=f"write results/{RECORD}.json (docs/plan.md)")
    parser.add_argument("--jobs", type=int, default=1, help="with --measure: runs at a time on the one GPU")
    parser.add_argument("--timeout", type=float, default=300.0, help="with --measure: seconds a run may take")
    parser.add_argument("--logs", type=Path, default=None, help="with --measure: keep each run's output here")
    parser.add_argument("--only", default="", help="with --measure: the cases whose name contains this (merged)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be 1 or more, got {args.jobs}")
    if args.measure:
        measured = measure_all(args.jobs, args.logs, args.timeout, args.only)
        path = records.results_dir() / f"{MEASURED}.json"
        if args.only and path.exists():  # the other cases keep their measurement
            measured = {**records.read(path)["extra"]["measured"], **measured}
        record = records.Record(MEASURED, command=["python", "-m", __spec__.name, "--measure"], device=DEVICE)
        record.extra.update(measured=measured, iterations=ITERATIONS)
        print(f"wrote {record.write()}")
        return 0 if all(found.get("peaks") for found in measured.values()) else 1
    path = records.results_dir() / f"{MEASURED}.json"
    if not path.exists():
        print(f"no {path}: run with --measure on a GPU first", file=sys.stderr)
        return 2
    measured_record = records.read(path)
    record = records.Record(RECORD, command=["python", "-m", __spec__.name, "--record"])
    record.host.update(measured_on=measured_record["host"], measured_at=measured_record["started_at"])
    table_out(record, rows(measured_record["extra"]["measured"]), "one GPU", "cases", write=args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
