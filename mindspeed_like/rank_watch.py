"""Ends what a rank leaves running when it dies: ``python -m mindspeed_like.rank_watch RANK_PID``.

Seen in issue 37 (item 7): after ``kill -9`` of one rank of a DP=2 Megatron-LM run during a
checkpoint save, two processes of that rank were still running long after torchrun had exited:
megatron's checkpoint-results queue (``dist_checkpointing/strategies/filesystem_async.py``:
``mp.get_context("spawn").Manager().Queue()``, a server process of about 500 MB) and
multiprocessing's resource tracker. torchrun ends the process group of every rank still running
(``os.killpg``) but not the group of a rank that has already died, and a ``Manager`` server does
not watch its parent. So nothing ends them.

``mindspeed_like.run`` starts this watcher beside each rank that leads its own session (torchrun
starts every rank with ``start_new_session=True``, so the rank's process group holds nothing but
the rank and what it started). The watcher waits for the rank to exit, however it exits, then ends
every process left in that group (SIGTERM, then SIGKILL after a grace period) and says which, in
one line on stderr. It ignores SIGINT/SIGTERM/SIGHUP (torchrun signals the whole group when it
stops a run; the watcher must still sweep after the rank is gone) and exits when its sweep is done.
A process that left the group (``setsid``) is out of its reach.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from collections.abc import Sequence

GRACE_SECONDS = 3.0


def group_members(pgid: int) -> dict[int, str]:
    """pid -> command name of every process in process group ``pgid`` (read from /proc)."""
    members = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                stat = handle.read()
        except OSError:
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid:  # state, ppid, pgrp
            members[int(entry)] = name
    return members


def wait_for_exit(pid: int) -> None:
    """Block until ``pid`` (this watcher's parent) has exited."""
    try:
        descriptor = os.pidfd_open(pid)
    except (AttributeError, OSError):  # Python < 3.9, Linux < 5.3, or already gone
        while os.getppid() == pid:
            time.sleep(0.5)
        return
    try:
        select.select([descriptor], [], [])
    finally:
        os.close(descriptor)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone, waiting for its parent
    except OSError:
        return False


def sweep(pgid: int, grace: float = GRACE_SECONDS) -> dict[int, str]:
    """End every process of group ``pgid`` but this one; returns what was running."""
    left = {pid: name for pid, name in group_members(pgid).items() if pid != os.getpid() and _alive(pid)}
    for pid in left:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(pid) for pid in left):
        time.sleep(0.1)
    for pid in left:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return left


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rank_pid = int(argv[0])
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_IGN)
    wait_for_exit(rank_pid)
    left = sweep(rank_pid)  # the rank led its group: the group id is its pid
    if left:
        listed = ", ".join(f"{pid} ({name})" for pid, name in sorted(left.items()))
        print(
            f"> mindspeed_like.run: the rank (pid {rank_pid}) has exited; ended {len(left)} process(es) "
            f"it left running: {listed}",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
