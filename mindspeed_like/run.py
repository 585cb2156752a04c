"""Run an existing Megatron training script with the adaptor imported first, unmodified.

    python -m mindspeed_like.run pretrain_gpt.py --mock-data ... --use-fused-rmsnorm
    torchrun --nproc_per_node 2 -m mindspeed_like.run pretrain_gpt.py ...
    mindspeed-like run pretrain_gpt.py ...

Equivalent to adding ``import mindspeed_like.megatron_adaptor`` as the script's first line:
the script's folder goes first on sys.path (as ``python script.py`` would put it), the
adaptor is imported, and the script runs as ``__main__`` with the remaining arguments.

Started without a launcher (no torchrun), the script gets the one-process world torchrun
``--nproc_per_node 1`` would give it: Megatron-LM initializes torch.distributed with ``env://``
and fails on a missing ``MASTER_ADDR`` otherwise. See :func:`one_process_world`.

Under torchrun each rank leads its own session; there a small watcher (``mindspeed_like.rank_watch``)
ends what the rank leaves running when it dies, e.g. after ``kill -9`` during a checkpoint save
(megatron's checkpoint-results ``Manager`` process). See :func:`watch_for_leftovers`.
"""

from __future__ import annotations

import os
import runpy
import socket
import subprocess
import sys
from collections.abc import MutableMapping, Sequence

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def one_process_world(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The variables torchrun sets for one process, put where a launcher did not: RANK=0,
    LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_WORLD_SIZE=1, MASTER_ADDR=127.0.0.1, a free MASTER_PORT.

    Only when no launcher is there: with ``WORLD_SIZE`` or ``RANK`` already set (torchrun, a
    scheduler's wrapper, the user) nothing is touched, and a variable the user set alone (e.g.
    ``MASTER_PORT``) is kept. Returns what was set (empty: nothing)."""
    if "WORLD_SIZE" in environ or "RANK" in environ:
        return {}
    wanted = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": None,
    }
    added = {}
    for name, value in wanted.items():
        if name not in environ:
            added[name] = environ[name] = value if value is not None else str(_free_port())
    return added


_watcher: subprocess.Popen | None = None


def watch_for_leftovers() -> subprocess.Popen | None:
    """Start ``mindspeed_like.rank_watch`` for this process, where this process leads its own session
    (torchrun's ranks do): its process group is then only itself and what it starts, which the
    watcher ends once this process has exited, however it exits. Elsewhere (a shell's job, whose
    group can hold a ``| tee``) nothing is started: that group is not ours to end. Linux only."""
    global _watcher
    if _watcher is not None or not sys.platform.startswith("linux") or os.getsid(0) != os.getpid():
        return None
    _watcher = subprocess.Popen(
        [sys.executable, "-m", "mindspeed_like.rank_watch", str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        close_fds=True,
    )
    return _watcher


def run_script(script: str, args: Sequence[str]) -> None:
    if not os.path.isfile(script):
        raise SystemExit(f"mindspeed_like.run: no such script: {script}")
    script = os.path.abspath(script)
    added = one_process_world()
    if added:
        print(
            "> mindspeed_like.run: no launcher, one process: "
            + " ".join(f"{k}={v}" for k, v in added.items())
            + " (as torchrun --nproc_per_node 1 would set; use torchrun for more processes)",
            file=sys.stderr,
            flush=True,
        )
    watch_for_leftovers()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    import mindspeed_like.megatron_adaptor  # noqa: F401  (the one line)

    runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    run_script(argv[0], argv[1:])


if __name__ == "__main__":
    main()
