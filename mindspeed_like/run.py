"""Run an existing Megatron training script with the adaptor imported first, unmodified.

    python -m mindspeed_like.run pretrain_gpt.py --mock-data ... --use-fused-rmsnorm
    torchrun --nproc_per_node 2 -m mindspeed_like.run pretrain_gpt.py ...
    mindspeed-like run pretrain_gpt.py ...

Equivalent to adding ``import mindspeed_like.megatron_adaptor`` as the script's first line:
the script's folder goes first on sys.path (as ``python script.py`` would put it), the
adaptor is imported, and the script runs as ``__main__`` with the remaining arguments.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence


def run_script(script: str, args: Sequence[str]) -> None:
    if not os.path.isfile(script):
        raise SystemExit(f"mindspeed_like.run: no such script: {script}")
    script = os.path.abspath(script)
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
