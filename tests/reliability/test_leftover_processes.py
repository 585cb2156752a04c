"""A rank killed with kill -9 leaves nothing running (issue 37 item 7).

Seen: after ``kill -9`` of one rank of a DP=2 Megatron-LM run during a save, megatron's
checkpoint-results ``Manager`` (a spawned server process, ~500 MB) and multiprocessing's resource
tracker of that rank were still running after torchrun exited. ``mindspeed_like.run`` now starts
``mindspeed_like.rank_watch`` beside a rank that leads its own session (as torchrun starts each),
which ends them once the rank is gone.

The default case reproduces it without Megatron-LM: a script run through ``python -m
mindspeed_like.run`` in its own session (``start_new_session=True``, what torchrun does) starts
megatron's kind of ``Manager`` and a forked child, then kills itself with SIGKILL. The opt-in case
(MEGATRON_LM_PATH, slow) is the user's run: torchrun, DP=2, a save every iteration, rank 1 killed
while saving.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from mindspeed_like import rank_watch
from mindspeed_like.testing import megatron_lm
from mindspeed_like.testing.parallel import free_port

SCRIPT = textwrap.dedent(
    """
    import multiprocessing, os, signal, sys, time

    if __name__ == "__main__":
        manager = multiprocessing.get_context("spawn").Manager()  # megatron's results queue holder
        queue = manager.Queue()
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
        child.start()
        with open(sys.argv[1], "w") as handle:
            handle.write(f"{manager._process.pid} {child.pid}")
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if rank_watch._alive(pid)]


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(pids)


def _end(pids: list[int]) -> None:
    for pid in _alive(pids):
        os.kill(pid, signal.SIGKILL)


def test_what_a_killed_rank_started_is_ended(tmp_path):
    script, pids_file = tmp_path / "rank.py", tmp_path / "pids"
    script.write_text(SCRIPT)
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0"}  # as under a launcher: no one-process world line
    rank = subprocess.Popen(
        [sys.executable, "-m", "mindspeed_like.run", str(script), str(pids_file)],
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    _, stderr = rank.communicate(timeout=120)  # the watcher holds stderr until its sweep is done
    assert rank.returncode == -signal.SIGKILL
    pids = [int(pid) for pid in pids_file.read_text().split()]
    try:
        assert not _gone_within(pids, 10), f"still running after the rank was killed: {_alive(pids)}"
        assert "ended" in stderr and all(str(pid) in stderr for pid in pids), stderr[-2000:]
    finally:
        _end(pids)


def test_no_watcher_outside_its_own_session(tmp_path):
    """A shell's job (not a session leader) gets no watcher: its group is not ours to end."""
    script = tmp_path / "quiet.py"
    script.write_text("import os\nprint(os.getpid())\n")
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "mindspeed_like.run", str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0 and "ended" not in out.stderr


@pytest.mark.slow
@pytest.mark.skipif(not megatron_lm.available(), reason=megatron_lm.SKIP_REASON)
def test_megatron_lm_rank_killed_during_a_save_leaves_no_process(tmp_path):
    log = tmp_path / "run.log"
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_LIKE_ARGS"}
    env.update(PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""), OMP_NUM_THREADS="1")
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        *megatron_lm.launcher(), *megatron_lm.TINY, "--train-iters", "40",
        "--save", str(tmp_path / "checkpoint"), "--save-interval", "2",
    ]  # fmt: skip
    with open(log, "w") as handle:
        launcher = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while "saving checkpoint at iteration       4" not in log.read_text() and time.monotonic() < deadline:
            assert launcher.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        ranks = sorted(pid for pid in _children(launcher.pid))
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        launcher.wait(timeout=300)
        left = [pid for rank in ranks for pid in rank_watch.group_members(rank)]
        deadline = time.monotonic() + 15
        while _alive(left) and time.monotonic() < deadline:
            time.sleep(0.5)
            left = [pid for rank in ranks for pid in rank_watch.group_members(rank)]
        assert not _alive(left), f"processes of the run still there: {[(p, _cmd(p)) for p in _alive(left)]}"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        for rank in ranks:
            _end(list(rank_watch.group_members(rank)))


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    stat = handle.read()
            except OSError:
                continue
            if int(stat[stat.rfind(")") + 2 :].split()[1]) == pid:
                found.append(int(entry))
    return found


def _cmd(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"
