"""Tests written for N ranks run under N gloo ranks: one launch per world size, watched.

Megatron-LM's tests are written for ``torchrun --nproc-per-node 8`` (``Utils`` reads ``WORLD_SIZE``
and ``LOCAL_RANK``); at world size 1 most of those fail with ``world_size (1) is not divisible by
8``. The plugin first runs every test in its own process; a test that asks for more ranks is set
aside with the size it asked for (rounded up to an allowed launch size: 2 and 4 by default, 8
opt-in), and each group is then run by one launch of N pytest processes, one per rank, that
report every phase as a JSON line. One rank failing while the others wait in a collective would
hang the group until gloo's timeout, so the launch is watched: a test that makes no progress for
``stall_s`` seconds, or a rank that dies, is failed with that reason (class ``timeout``) and the
group is relaunched for the tests after it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mindspeed_like.workloads.parallel import free_port

STARTUP_S = float(os.environ.get("MEGATRON_UNIT_STARTUP_S", "900"))
DIVERGED_S = float(os.environ.get("MEGATRON_UNIT_DIVERGED_S", "60"))
"""How long the other ranks may go on with a test after one rank's call failed: past it the ranks
have diverged (the failing rank left a collective the others wait in), the test is charged with that
rank's failure and the rest of the group relaunched, instead of waiting out the stall limit."""
BROKEN_GROUP_EXIT = 3
"""A rank's exit status after a test broke its gloo connections, or after its threads outgrew
MAX_THREADS (the launcher relaunches the rest on fresh ranks)."""
MAX_THREADS = int(os.environ.get("MEGATRON_UNIT_MAX_THREADS", "400"))
"""Threads a rank may hold between tests. megatron_fsdp's fully_shard tests left ~15 threads a test in
each of 8 ranks that no process-group cleanup frees (922 threads a rank after 59 tests; the host's
load average reached 200 and another launch beside it timed out on every test); past this the rank
ends after its current test and the rest of its group runs on fresh ranks."""


def too_many_threads(limit: int | None = None) -> bool:
    """Whether this process holds more than ``limit`` (default MAX_THREADS) threads (Linux /proc)."""
    try:
        count = len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: never recycled
        return False
    return count > (MAX_THREADS if limit is None else limit)


_BROKEN_GROUP = re.compile(
    r"gloo/transport/tcp/|Connection closed by peer|caused pair closure|Timed out waiting \d+ms for (recv|send)"
)


def broke_the_process_group(failure_text: str) -> bool:
    """Whether a failure is gloo's transport giving up (a peer died or left mid-collective): the
    rank's default group is then unusable for any later test."""
    return bool(_BROKEN_GROUP.search(failure_text))


SEVERITY = {"passed": 0, "skipped": 1, "failed": 2}


@dataclass
class RankResult:
    """What the ranks reported for one test: per phase, every rank's serialized report."""

    nodeid: str
    phases: dict[str, list[dict]] = field(default_factory=dict)

    def merged(self) -> list[dict]:
        """One report per phase: rank 0's, unless another rank did worse (its report, rank named)."""
        out = []
        for when in ("setup", "call", "teardown"):
            reports = self.phases.get(when)
            if not reports:
                continue
            worst = max(reports, key=lambda r: (SEVERITY.get(r["outcome"], 2), -r.get("_rank", 0)))
            out.append(worst)
        return out


def group_by_size(needs: Iterable[tuple[str, int]]) -> dict[int, list[str]]:
    """Node ids grouped by the launch size each asked for, smallest size first, order kept."""
    groups: dict[int, list[str]] = {}
    for nodeid, size in needs:
        groups.setdefault(size, []).append(nodeid)
    return dict(sorted(groups.items()))


def _log_tails(rank_logs: list[Path]) -> str:
    """The last lines of each rank's log."""
    tails = []
    for path in rank_logs:
        try:
            tails.append(
                f"--- {path.name} (last lines)\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
            )
        except OSError:
            pass
    return "\n".join(tails)


def _stalled_report(nodeid: str, why: str, rank_logs: list[Path]) -> dict:
    return {
        "nodeid": nodeid,
        "when": "call",
        "outcome": "failed",
        "longrepr": f"rank-timeout: {why}\n" + _log_tails(rank_logs) + f"\nrank-timeout: {why}",
        "duration": 0.0,
        "_harness": True,
    }


def _relaunch_after(procs: list[subprocess.Popen], started: dict[int, str]) -> str | None:
    """The test after which a rank exited because it broke the rank's process group (its report is
    in; the tests the other ranks started after it are not failures and rerun), or None."""
    for rank, proc in enumerate(procs):
        if proc.poll() == BROKEN_GROUP_EXIT:
            return started.get(rank, "")
    return None


def launch(
    nodeids: list[str],
    size: int,
    child_args: list[str],
    *,
    cwd: str,
    stall_s: float,
    on_result: Callable[[RankResult], None],
    env: dict[str, str] | None = None,
) -> None:
    """Run ``nodeids`` under ``size`` ranks; ``on_result`` gets each test's result as it finishes.

    A stall or a dead rank fails the test in progress and relaunches the rest (never hangs).
    """
    remaining = list(nodeids)
    last_was_empty = False
    while remaining:
        done = _launch_once(
            remaining,
            size,
            child_args,
            cwd=cwd,
            stall_s=stall_s,
            on_result=on_result,
            env=env,
            charge_if_none_ran=last_was_empty,
        )
        last_was_empty = not done
        remaining = [n for n in remaining if n not in done]


def _launch_once(
    nodeids: list[str],
    size: int,
    child_args: list[str],
    *,
    cwd: str,
    stall_s: float,
    on_result: Callable[[RankResult], None],
    env: dict[str, str] | None,
    charge_if_none_ran: bool = True,
) -> set[str]:
    """One launch of ``size`` ranks; their outputs and logs live in a folder removed when it returns
    (``TemporaryDirectory``'s finalizer removes it on an exception too). Ranks that exit before any test
    starts have their logs' tails printed; the tests are charged "ran no test" only with
    ``charge_if_none_ran`` (:func:`launch` tries once more first: level 2's 8-rank Megatron-FSDP piece lost
    its last 12 tests to one such launch on a loaded host, the cause not kept)."""
    folder = tempfile.TemporaryDirectory(prefix=f"megatron-unit-ws{size}-")
    workdir = Path(folder.name)
    port = free_port()
    procs, outs, logs = [], [], []
    for rank in range(size):
        out = workdir / f"rank{rank}.jsonl"
        log = workdir / f"rank{rank}.log"
        rank_env = {
            **os.environ,
            **(env or {}),
            "WORLD_SIZE": str(size),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        # one pytest basetemp per rank, all in this launch's folder: megatron's session fixture
        # `tmp_path_dist_ckpt` is the basetemp's grandparent / "tmp_dist_ckpt", shared by the ranks
        # as megatron means it, and by no other launch or session (rank 0 removes it at its end; a
        # shared /tmp/pytest-of-<user>/tmp_dist_ckpt lost another session's checkpoint mid-save:
        # FileNotFoundError on its .metadata.tmp)
        basetemp = f"--basetemp={workdir / f'basetemp{rank}'}"
        cmd = [sys.executable, "-m", "pytest", *child_args, basetemp, f"--megatron-child={out}", *nodeids]
        with open(log, "w") as handle:
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=rank_env, stdout=handle, stderr=subprocess.STDOUT))
        outs.append(out)
        logs.append(log)
    positions = [0] * size
    results: dict[str, RankResult] = {}
    started: dict[int, str] = {}
    done: set[str] = set()
    first_failure: dict[str, float] = {}  # test -> when a rank first reported its call failed

    def charge(result: RankResult) -> None:
        """The test's outcome is settled: handed on once, and not rerun by a relaunch."""
        done.add(result.nodeid)
        on_result(result)

    last_progress = time.monotonic()
    # the watcher ended the launch itself (a divergence or a stall, already charged): the ranks it killed
    # crashed nothing, and a test one of them had started next is relaunched, not failed "ranks exited [-9]"
    stopped_here = False
    try:
        while True:
            progressed = False
            for rank, path in enumerate(outs):
                if not path.exists():
                    continue
                with open(path) as handle:
                    handle.seek(positions[rank])
                    for line in handle:
                        if not line.endswith("\n"):
                            break
                        positions[rank] += len(line)
                        progressed = True
                        event = json.loads(line)
                        if event.get("event") == "start":
                            started[rank] = event["nodeid"]
                            continue
                        event["_rank"] = rank
                        result = results.setdefault(event["nodeid"], RankResult(event["nodeid"]))
                        result.phases.setdefault(event["when"], []).append(event)
                        if event["when"] == "call" and event.get("outcome") == "failed":
                            first_failure.setdefault(event["nodeid"], time.monotonic())
                        if event["when"] == "teardown":
                            count = len(result.phases["teardown"])
                            if count == size and event["nodeid"] not in done:
                                charge(result)
            if progressed:
                last_progress = time.monotonic()
            alive = [p.poll() is None for p in procs]
            if not any(alive):
                break
            # before the first test starts, the ranks are importing torch and megatron: on a loaded
            # host that alone can take minutes, so the limit then is STARTUP_S, not stall_s
            limit = stall_s if started else max(stall_s, STARTUP_S)
            stalled = time.monotonic() - last_progress > limit
            died = not all(alive) and time.monotonic() - last_progress > 30
            if died and _relaunch_after(procs, started) is not None:
                break  # a rank left a broken group: the others' current test reruns on fresh ranks
            diverged = [n for n, t in first_failure.items() if n not in done and time.monotonic() - t > DIVERGED_S]
            if diverged:  # charged with the failure its ranks reported; the rest of the group relaunches
                charge(results[diverged[0]])
                stopped_here = True
                break
            if stalled or died:
                current = started.get(0) or next(iter(started.values()), None)
                why = (
                    f"no progress for {limit:.0f} s at world size {size}"
                    if stalled
                    else f"a rank exited ({[p.poll() for p in procs]}) while the others waited"
                )
                if current and current not in done:
                    result = results.setdefault(current, RankResult(current))
                    result.phases = {"call": [_stalled_report(current, why, logs)]}
                    charge(result)
                stopped_here = True
                break
            time.sleep(0.5)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()
    # a rank that exited without finishing the test it started (crash): that test failed
    if len(done) < len(nodeids) and not stopped_here:
        current = started.get(0) or next(iter(started.values()), None)
        breaker = _relaunch_after(procs, started)
        if current and current not in done and (breaker is None or current == breaker):
            charge(
                RankResult(
                    current, {"call": [_stalled_report(current, f"ranks exited {[p.returncode for p in procs]}", logs)]}
                )
            )
        elif not started:  # nothing ran at all (collection failed in the ranks): fail them all once
            why = f"ranks exited {[p.returncode for p in procs]} before a test"
            print(f"{why}\n{_log_tails(logs)}"[-6000:], file=sys.stderr, flush=True)
            for nodeid in nodeids if charge_if_none_ran else ():
                charge(
                    RankResult(
                        nodeid, {"call": [_stalled_report(nodeid, "the ranks ran no test (collection failed?)", logs)]}
                    )
                )
    folder.cleanup()
    return done
