"""The Megatron-LM flag sweep: run ``pretrain_gpt.py`` with the import line for every case of
:mod:`mindspeed_like.testing.megatron_lm_flags`, in batches, and say what each flag did.

A run is ``python -m mindspeed_like.run pretrain_gpt.py`` (one process, the import line first) on
the tiny model of :data:`megatron_lm.TINY` for :data:`ITERATIONS` iterations. Cases that need the
same companions share a run (a batch, at most :data:`BATCH` cases, never two of one flag); each
batch's printed ``lm loss`` and ``grad norm`` are compared with the run of its companions alone,
on a CPU megatron's own path (the import line switches no acceleration on; without it megatron
cannot start on a CPU). A batch that does not train as its reference did is bisected down to the
flag responsible. The outcome of each case (:data:`OUTCOMES`):

* ``same``: trained; every printed loss and grad norm equal to the run without it (digit for digit);
* ``changed``: trained, finite losses, different ones (the flag changes the math: precision, a
  schedule, skipped iterations; or a flag that acts on an earlier batch member);
* ``no training``: exited 0 without an iteration (``--skip-train``);
* ``stopped by the rerun machine``: megatron's result validation ended the run on purpose (exit code
  16 or 17 after an iteration: ``--error-injection-rate`` makes it);
* ``refused``: stopped at start-up by mindspeed_like with its message (a flag a CPU cannot run);
* ``stopped at start-up``: stopped by Megatron-LM itself before training (its argument checks,
  a package it imports), its last error line recorded;
* ``crashed at start-up`` (a CUDA call before training) / ``crashed mid-run`` / ``hung``: failures.

The previous record (results/megatron-lm-flags.json) tells which cases changed the math or
stopped last time: those run alone, so a batch is not bisected for them every time.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from mindspeed_like.testing.megatron_lm_flags import Case, fill
from mindspeed_like.workloads import megatron_lm

ITERATIONS = 3
BATCH = 8
TIMEOUT = 150  # a run of the tiny model takes 10-60 s (the latter on a loaded 2-core host)
SAME, CHANGED, NO_TRAINING, REFUSED, STOPPED = "same", "changed", "no training", "refused", "stopped at start-up"
CRASHED_START, CRASHED_MID, HUNG, NOT_TRIED = "crashed at start-up", "crashed mid-run", "hung", "not tried"
RERUN_EXIT = "stopped by the rerun machine"
OUTCOMES = (SAME, CHANGED, NO_TRAINING, RERUN_EXIT, REFUSED, STOPPED, CRASHED_START, CRASHED_MID, HUNG, NOT_TRIED)
PASSED = (SAME, CHANGED, NO_TRAINING, RERUN_EXIT)
# megatron's rerun state machine (result validation, error injection) ends a run on purpose with these
# (megatron/core/rerun_state_machine.py: EXIT_CODE_RESUME_TO_DISAMBIGUATE, EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
RERUN_EXIT_CODES = (16, 17)
FAILURES = (CRASHED_START, CRASHED_MID, HUNG)
# the last marker Megatron-LM prints before its training loop starts: a failure after it is mid-run
TRAINING_STARTS = "after dataloaders are built"
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
PRINTED = re.compile(r"\| (lm loss|grad norm): ([^ |]+)")
ERROR_LINE = re.compile(r"^(?:[\w.]+(?:Error|Exception|Interrupt)|AssertionError|SystemExit)\b.*|.*: error: .*")
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")
NEEDS_CUDA = re.compile(r"cuda|nvcc|nccl|not compiled with|nvml|cudart", re.IGNORECASE)


# the opt-in tests' tiny model zeroes dropout; the sweep keeps megatron's default (0.1), as users run it:
# a flag that disturbs the dropout streams (recompute, checkpointing, a host twin of megatron's RNG
# tracker) then shows as changed losses instead of hiding behind dropout 0
ZEROED_DROPOUT = ("--attention-dropout", "--hidden-dropout")


def base_arguments() -> list[str]:
    """The tiny model of the opt-in Megatron-LM tests at megatron's default dropout, for ITERATIONS iterations."""
    base = list(megatron_lm.TINY)
    for flag in ZEROED_DROPOUT:
        at = base.index(flag)
        del base[at : at + 2]
    base[base.index("--train-iters") + 1] = str(ITERATIONS)
    return base


@dataclass
class Run:
    extra: list[str]
    returncode: int | None  # None: timed out
    output: str
    seconds: float
    printed: dict[int, dict[str, str]] = field(default_factory=dict)

    @property
    def started_training(self) -> bool:
        return TRAINING_STARTS in self.output or bool(self.printed)

    def error_line(self) -> str:
        lines = [line.strip() for line in self.output.splitlines() if line.strip()]
        refusal = [i for i, line in enumerate(lines) if line.startswith("mindspeed_like: ")]
        if refusal:  # our message and its detail lines (toolkit/uncaught.py)
            start = refusal[-1]
            return " ".join(lines[start : start + 4]).split(" (raised at")[0]
        errors = [line for line in lines if ERROR_LINE.match(RANK_PREFIX.sub("", line))]
        return (errors[-1] if errors else (lines[-1] if lines else ""))[:400]


def run_pretrain(extra: list[str], timeout: float = TIMEOUT) -> Run:
    """``pretrain_gpt.py`` with the import line (``python -m mindspeed_like.run``: one process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MINDSPEED_LIKE_ARGS", "MINDSPEED_LIKE_TRACEBACK")}
    bin_dir = os.path.dirname(sys.executable)  # megatron compiles its helpers with the python3 on PATH
    env.update(PATH=bin_dir + os.pathsep + env.get("PATH", ""), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # mindspeed_like.run makes the one-process world with a free port
    command = [sys.executable, *megatron_lm.launcher(), *base_arguments(), *extra]
    start = time.monotonic()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        returncode, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as expired:
        returncode = None
        output = "".join(
            part.decode() if isinstance(part, bytes) else (part or "") for part in (expired.stdout, expired.stderr)
        )
    run = Run(extra, returncode, output, time.monotonic() - start)
    for line in output.splitlines():
        match = LINE.search(line)
        if match:
            run.printed[int(match.group(1))] = dict(PRINTED.findall(line))
    return run


def outcome(run: Run, reference: Run | None) -> tuple[str, str]:
    """What ``run`` did, compared with ``reference`` (the same companions without the cases)."""
    if run.returncode is None:
        return HUNG, f"no exit within {TIMEOUT} s (iterations printed: {sorted(run.printed)})"
    if run.returncode in RERUN_EXIT_CODES and run.printed:
        return RERUN_EXIT, f"exit code {run.returncode} after iteration {max(run.printed)}, as megatron means it to"
    if run.returncode != 0:
        line = run.error_line()
        if "mindspeed_like: " in line:
            return REFUSED, line.removeprefix("mindspeed_like: ")
        if run.started_training:
            return CRASHED_MID, line
        if NEEDS_CUDA.search(line):
            return CRASHED_START, line
        return STOPPED, line
    if not run.printed:
        return NO_TRAINING, "exited 0 without a training iteration"
    losses = [float(v["lm loss"]) for v in run.printed.values() if "lm loss" in v]
    if not losses:  # megatron prints no loss for an iteration its loss scaler skipped (fp16's first ones)
        return CHANGED, f"iterations {sorted(run.printed)} printed without a loss: skipped by the loss scaler"
    if not all(math.isfinite(x) for x in losses):
        return CRASHED_MID, f"non-finite losses: {run.printed}"
    if reference is None or not reference.printed:
        return CHANGED, "no reference run to compare with"
    common = sorted(set(run.printed) & set(reference.printed))
    if common and all(run.printed[i] == reference.printed[i] for i in common):
        return SAME, f"iterations {common[0]}-{common[-1]}"
    differs = [i for i in common if run.printed[i] != reference.printed[i]]
    if not common:
        return CHANGED, f"printed iterations {sorted(run.printed)}, the reference {sorted(reference.printed)}"
    first = differs[0]
    return CHANGED, f"iteration {first}: {run.printed[first]} vs {reference.printed[first]}"


@dataclass
class Result:
    case: Case
    outcome: str
    detail: str
    batch: int  # the size of the run that decided it
    seconds: float


def sweep(
    cases: Iterable[Case],
    previous: dict[str, str] | None = None,
    jobs: int = 2,
    runner: Callable[[list[str]], Run] = run_pretrain,
    log: Callable[[str], None] = print,
    progress: Callable[[list[Result]], None] | None = None,
) -> tuple[list[Result], dict[str, float]]:
    """Every case's result; and the number of runs and the wall seconds. ``progress`` gets the
    results so far after every finished run (a lane cut short still leaves what it found).

    The runs form one queue, ``jobs`` at a time, with no rounds: a group's batches start as soon
    as its reference run ends, a failed batch's halves as soon as it ends. A case whose command
    line is another group's reference (``--fp16`` alone is the reference of ``--loss-scale``)
    takes that run's result instead of running it again."""
    tmp = tempfile.mkdtemp(prefix="megatron-lm-flags-")  # the runs' --save folders, removed after
    try:
        return _sweep(list(cases), previous or {}, jobs, runner, log, progress, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sweep(
    cases: list[Case],
    previous: dict[str, str],
    jobs: int,
    runner: Callable[[list[str]], Run],
    log: Callable[[str], None],
    progress: Callable[[list[Result]], None] | None,
    tmp: str,
) -> tuple[list[Result], dict[str, float]]:
    results: list[Result] = [Result(c, NOT_TRIED, c.note, 0, 0.0) for c in cases if c.note]
    todo = [c for c in cases if not c.note]
    checkpoint = os.path.join(tmp, "checkpoint")
    counter = {"runs": 0}
    start = time.monotonic()

    def execute(tokens: tuple[str, ...]) -> Run:
        run = runner(fill(tokens, tempfile.mkdtemp(dir=tmp), checkpoint))
        counter["runs"] += 1
        return run

    failed_batches: list[tuple[list[Case], str, str]] = []
    groups: dict[tuple[str, ...], list[Case]] = {}
    for case in todo:
        groups.setdefault(case.companions, []).append(case)
    reused = {case for case in todo if _tokens([case]) in groups and _tokens([case]) != case.companions}
    references: dict[tuple[str, ...], Run] = {}
    if any("{checkpoint}" in c.companions for c in todo):
        prepared = execute(("--save", checkpoint, "--save-interval", "2", "--exit-interval", "2"))
        log(f"checkpoint for the --load cases: {outcome(prepared, None)[0]} ({prepared.seconds:.0f} s)")

    def decide(batch: list[Case], run: Run) -> list[list[Case]]:
        """Record the batch's result, or return its halves to run."""
        kind, detail = outcome(run, references[batch[0].companions])
        if len(batch) == 1 or kind == SAME:
            results.extend(Result(c, kind, detail, len(batch), run.seconds) for c in batch)
            log(f"{kind}: {', '.join(c.name for c in batch)}" + (f" ({detail})" if len(batch) == 1 else ""))
            return []
        failed_batches.append((batch, kind, detail))
        log(f"bisecting ({kind}): {', '.join(c.name for c in batch)}")
        half = len(batch) // 2
        return [batch[:half], batch[half:]]

    waiting = set(reused)  # cases that take a reference's result, once both runs they need are done

    def ready(group: tuple[str, ...]) -> list[list[Case]]:
        """A reference ended: the batches of its group to run (and the reused cases now decidable)."""
        for case in sorted(waiting, key=lambda c: c.name):
            own = _tokens([case])
            if case.companions in references and own in references:
                waiting.discard(case)
                if _passed_reference(case.companions, references, results, [case]):
                    decide([case], references[own])
        members = [c for c in groups[group] if c not in reused]
        if not members or not _passed_reference(group, references, results, members):
            return []
        return _batches(members, previous)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        running: dict = {pool.submit(execute, group): ("reference", group) for group in groups}
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                kind, payload = running.pop(future)
                if kind == "reference":
                    references[payload] = future.result()
                    follow = ready(payload)
                else:
                    follow = decide(payload, future.result())
                for batch in follow:
                    running[pool.submit(execute, _tokens(batch))] = ("batch", batch)
            if progress is not None:
                progress(list(results))
    order = {case: index for index, case in enumerate(cases)}
    results.sort(key=lambda r: order[r.case])
    return results, {
        "runs": counter["runs"],
        "wall_seconds": time.monotonic() - start,
        "interactions": interactions(failed_batches, results),
    }


def _passed_reference(
    group: tuple[str, ...], references: dict[tuple[str, ...], Run], results: list[Result], members: list[Case]
) -> bool:
    """Whether ``group``'s companions alone trained; if not its members are recorded as not tried."""
    if not group:
        return True
    kind, detail = outcome(references[group], None)
    if kind in PASSED:
        return True
    why = f"its companions {' '.join(group)} alone: {kind}: {detail}"
    results.extend(Result(c, NOT_TRIED, why, 0, 0.0) for c in members)
    return False


def interactions(failed: list[tuple[list[Case], str, str]], results: list[Result]) -> list[dict[str, str]]:
    """Batches that failed although each of their flags, alone, did not: flags that fail together (the
    sweep's first full run found --async-save with --use-persistent-ckpt-worker never ending)."""
    outcome_of = {r.case: r.outcome for r in results}
    found = []
    for batch, kind, detail in failed:
        if kind in FAILURES and all(outcome_of.get(case) not in FAILURES for case in batch):
            found.append({"flags": " ".join(c.name for c in batch), "outcome": kind, "detail": detail})
    # the smallest such batches name the interaction; a larger one that holds one of them adds nothing
    names = [set(item["flags"].split(" --")) for item in found]
    return [item for item, own in zip(found, names) if not any(other < own for other in names)]


def _batches(members: list[Case], previous: dict[str, str]) -> list[list[Case]]:
    """Cases that kept the losses last time (or are new) share runs, at most BATCH and one case per
    flag each; the others run alone."""
    alone = [[c] for c in members if previous.get(c.name, SAME) != SAME]
    shared = [c for c in members if previous.get(c.name, SAME) == SAME]
    batches: list[list[Case]] = []
    for case in shared:
        target = next((b for b in batches if len(b) < BATCH and all(o.dest != case.dest for o in b)), None)
        if target is None:
            batches.append([case])
        else:
            target.append(case)
    return alone + batches


def _tokens(batch: list[Case]) -> tuple[str, ...]:
    return (*batch[0].companions, *(token for case in batch for token in case.args))
