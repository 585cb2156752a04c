"""Megatron-LM's own ``pretrain_gpt.py``: megatron's path vs ``python -m mindspeed_like.run`` at
optimization levels 1 and 2, one device, the same command line (issue 36's pair).

Each arm is ``torch.distributed.run --nproc_per_node 1`` in its own process: megatron's own path is
``pretrain_gpt.py ARGS`` (on a GPU without TransformerEngine and apex: ``--transformer-impl local
--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-rope-fusion
--no-persist-layer-norm``, notes/gpu.md), the library's ``-m mindspeed_like.run pretrain_gpt.py ARGS
--optimization-level N``. On a CPU megatron's own path cannot start (it needs CUDA): its arm there is
the runner at level 0 (megatron's code through the CPU adapter), which is what ``--quick`` checks.

Read from each arm's log: ``elapsed time per iteration (ms)`` of every log interval (the median of
those after the first, which holds the compile and warm-up), the ``max allocated`` of megatron's
memory report (after the first interval), the last ``lm loss``. An arm that fails or times out
keeps its row with the reason and the log's tail; the others still run.

``MEGATRON_LM_PATH`` (or ``--megatron-lm``): a Megatron-LM checkout of the tag of the installed
megatron-core (core_v0.16.1). megatron's own path compiles its dataset helpers with ``make`` and
the megatron-core wheel ships no Makefile: where the installed package lacks it, the checkout's is
copied there first (said in one line), as a user of the wheel must.

    python benchmarks/megatron_lm_pair.py [--quick] [--device cuda] [--levels 1 2] [--train-iters 16]
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common  # benchmarks/ is the script directory

ROOT = Path(__file__).resolve().parents[1]
GPU_FLAGS = (
    "--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-rope-fusion "
    "--no-persist-layer-norm"
).split()
ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
LM_LOSS = re.compile(r"lm loss: ([0-9.E+-]+)")
MAX_ALLOCATED = re.compile(r"max allocated: ([0-9.]+)")


def model_args(quick: bool, train_iters: int) -> list[str]:
    """The issue's model (8 layers, hidden 2048, 16 heads, GQA 4, seq 4096, global batch 4, bf16),
    or a tiny one with ``--quick``."""
    if quick:
        size = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 --seq-length 64 "
        size += "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --log-interval 2"
    else:
        size = "--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --num-query-groups 4 --seq-length 4096 "
        size += "--max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 4 --log-interval 4"
    common_args = (
        "--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --group-query-attention "
        f"--train-iters {train_iters} --lr 1e-4 --eval-iters 0 --eval-interval 1000 --normalization RMSNorm "
        "--swiglu --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear "
        "--bf16 --seed 1234"
    )
    return size.split() + common_args.split()


def _dataset_makefile(checkout: Path) -> None:
    """megatron's own path runs ``make`` in the installed megatron/core/datasets; the wheel has no Makefile."""
    import megatron.core.datasets as datasets

    installed = Path(datasets.__file__).parent / "Makefile"
    source = checkout / "megatron" / "core" / "datasets" / "Makefile"
    if not installed.exists() and source.exists():
        shutil.copy(source, installed)
        print(f"copied {source} to {installed} (the megatron-core wheel ships no Makefile; megatron runs make there)")


def run_arm(label: str, script_args: list[str], extra: list[str], timeout: float, log_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MINDSPEED_LIKE_ARGS"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # megatron's make uses python3
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *script_args, *extra,
    ]  # fmt: skip
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        output, failure = done.stdout + done.stderr, None if done.returncode == 0 else f"exit code {done.returncode}"
    except subprocess.TimeoutExpired as expired:
        raw = expired.stdout or ""
        output = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        failure = f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - start
    log_dir.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^\w.-]+", "_", label).strip("_")
    (log_dir / f"megatron_lm_pair-{safe}.log").write_text(" ".join(command) + "\n" + output)
    times = [float(v) for v in ITERATION_MS.findall(output)]
    losses = [float(v) for v in LM_LOSS.findall(output)]
    allocated = [float(v) for v in MAX_ALLOCATED.findall(output)]
    row = dict(
        arm=label,
        ms_per_iteration=statistics.median(times[1:] or times) if times else None,
        first_interval_ms=times[0] if times else None,
        max_allocated_MB=max(allocated) if allocated else None,
        last_lm_loss=losses[-1] if losses else None,
        wall_s=wall,
        status=failure or "ok",
    )
    if failure:
        print(f"{label}: {failure}\n{output[-3000:]}", flush=True)
    common.add_samples("ms_per_interval", [t / 1e3 for t in times])
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _free_port() -> int:
    from mindspeed_like.testing.parallel import free_port

    return free_port()


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM_PATH", ""), help="Megatron-LM checkout")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2], help="the runner's optimization levels")
    p.add_argument(
        "--train-iters", type=common.positive_int, default=None, help="iterations per arm (default 16; --quick 6)"
    )
    p.add_argument("--timeout", type=common.above(0), default=240, help="seconds per arm")
    p.add_argument("--logs", default=None, help="folder for each arm's log (default: beside the record)")
    args = p.parse_args()
    checkout = Path(args.megatron_lm)
    pretrain = checkout / "pretrain_gpt.py"
    if not pretrain.is_file():
        print(f"megatron_lm_pair: not run: no pretrain_gpt.py in {str(checkout) or '(unset)'}; set MEGATRON_LM_PATH")
        return
    device = common.device().type
    model = model_args(args.quick, args.train_iters or (6 if args.quick else 16))
    if device != "cpu":
        model += GPU_FLAGS
        _dataset_makefile(checkout)
    logs = Path(args.logs) if args.logs else Path(os.environ.get("MINDSPEED_LIKE_RESULTS", ROOT / "results")) / "logs"
    runner = ["-m", "mindspeed_like.run", str(pretrain)]
    arms = (
        [("megatron", [str(pretrain)], [])]
        if device != "cpu"
        else [("megatron (level 0)", runner, ["--optimization-level", "0"])]
    )
    arms += [(f"level {level}", runner, ["--optimization-level", str(level)]) for level in args.levels]
    results = common.Results("Megatron-LM pretrain_gpt.py, one device: megatron's path vs mindspeed_like.run")
    base = None
    for label, script, extra in arms:
        row = run_arm(label, script, model + extra, args.timeout, logs)
        base = base or row
        if row is not base:  # None where either arm gave no figure (failed, timed out)
            row["speedup"] = _ratio(base["ms_per_iteration"], row["ms_per_iteration"])
            row["allocated_ratio"] = _ratio(row["max_allocated_MB"], base["max_allocated_MB"])
        results.add(**row)
    results.print_table()
    results.write_json(args.json, arguments=model)


if __name__ == "__main__":
    main()
