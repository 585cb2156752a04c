"""Run a training script as ``mindspeed_like.run`` does, and print at exit which features ran.

    python -m mindspeed_like.testing.reach pretrain_gpt.py ARGS...
    torchrun --nproc_per_node 2 -m mindspeed_like.testing.reach pretrain_gpt.py ARGS...

The "features on" line says what was switched on, not what megatron called into: a feature whose
patched function the model never reaches would be listed all the same. This launcher counts the
calls into every WRAP patch (``ENGINE.calls``, as `mindspeed-like compare`'s worker does) from
before the adaptor applies anything, and at exit each rank prints one line::

    > mindspeed_like reach rank 0: {"on": [...], "ran": {...}, "fell_back": {...}, "served": {...}, "idle": [...]}

``idle`` = on, never called, no fallback and no "served by" recorded: "on but never reached". A
feature made only of REPLACE/PROVIDE patches (classes, constants) is never counted, so ``idle``
also lists those; :func:`read` hands the dict back for tests to judge.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import re
import sys

LINE = re.compile(r"> mindspeed_like reach rank (\d+): (\{.*\})\s*$")


def _report() -> dict:
    from mindspeed_like.runtime import ENGINE, current_config, enabled_feature_names
    from mindspeed_like.toolkit.fallback import fell_back, served

    on = enabled_feature_names(current_config())
    calls = dict(ENGINE.calls or {})
    fell, serve = fell_back(), served()
    idle = [name for name in on if not calls.get(name) and name not in fell and name not in serve]
    import mindspeed_like

    patches = {
        name: sorted({f"{r.kind} {r.status} {r.target}" for r in mindspeed_like.report() if r.feature == name})
        for name in idle
    }
    return {"on": on, "ran": calls, "fell_back": fell, "served": serve, "idle": idle, "idle_patches": patches}


def _print_report() -> None:
    rank = os.environ.get("RANK", "0")
    print(f"> mindspeed_like reach rank {rank}: {json.dumps(_report(), sort_keys=True)}", flush=True)


def read(output: str) -> dict[int, dict]:
    """Each rank's reach report from a run's output, by rank."""
    reports = {}
    for line in output.splitlines():
        match = LINE.search(line)
        if match:
            reports[int(match.group(1))] = json.loads(match.group(2))
    return reports


def main(argv: list[str] | None = None) -> None:
    from mindspeed_like.runtime import ENGINE

    ENGINE.calls = collections.Counter()  # before the adaptor's import applies the first patch
    atexit.register(_print_report)
    from mindspeed_like.run import main as run_main

    run_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
