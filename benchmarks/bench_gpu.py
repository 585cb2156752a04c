"""`make bench-gpu`: the GPU figures of the docs in one prepared run (~8 minutes on one H100).

    python3 benchmarks/bench_gpu.py [--out results] [--budget 480] [--only NAME ...]
    python3 benchmarks/bench_gpu.py --smoke            # every item at tiny sizes on this host's device

Runs the items of ``ITEMS`` in order, each as ``<this python> <command>`` in its own process with its
own timeout, records to ``--out`` (``MINDSPEED_LIKE_RESULTS``: results/ by default, where ``make
docs`` reads them; each benchmark names its record ``<name>-cuda`` on a GPU, compare runs are named
here), each item's output to ``<out>/logs/<item>.log``. An item that fails or times out does not
stop the others; when the budget is spent the rest are skipped, each said. At the end one compact
summary table: every item's status and seconds, and the headline figures read back from its record.

Needs no make and no venv: the python that runs this (3.12 with torch on the GPU machine, megatron-core
and liger-kernel installed with ``pip install --target DIR`` and DIR on PYTHONPATH). The checkout's
root is put on PYTHONPATH for the children, so the library needs no install. torch.compile is on
(``TORCHDYNAMO_DISABLE=0``), as users run megatron. Megatron-LM's pair needs ``MEGATRON_LM_PATH``
(a core_v0.16.1 checkout with pretrain_gpt.py); without it that item says so and is skipped.

The order is the order of importance (the issue's targets first), and the budget of each item was
set from the first H100 run (notes/gpu.md: a one-repeat compare at the llama size took 65-73 s
wall, of which ~8 s the features arm's first compile; a 16-iteration Megatron-LM arm ~45 s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = ["-m", "mindspeed_like.cli", "compare"]
COMPARE_TINY = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --steps 3"


@dataclass(frozen=True)
class Item:
    """One measurement: ``args`` at the documented size, ``smoke`` the size options for ``--smoke``
    (replacing ``size``), ``timeout`` seconds on a GPU, ``record`` the record it writes."""

    name: str
    timeout: int
    args: str
    size: str = ""
    smoke: str = ""
    record: str = ""
    needs: tuple[str, ...] = field(default=())

    def record_name(self, device: str, smoke: bool) -> str:
        """``<record>-cuda`` on a GPU; ``-smoke`` in a smoke run, which never writes a device's record."""
        return f"{self.record}-{'smoke' if smoke else device}"

    def command(self, device: str, smoke: bool, out: Path) -> list[str]:
        size = self.smoke if smoke else self.size
        line = f"{self.args} {size} --record {self.record_name(device, smoke)}"
        return line.replace("{device}", device).replace("{out}", str(out / "compare" / self.name)).split()


def _compare(name: str, timeout: int, preset: str, level: int, size: str, extra: str = "", smoke: str = COMPARE_TINY):
    args = f"{' '.join(CLI)} --preset {preset} --device {{device}} --optimization-level {level} --repeats 1 --quiet "
    args += f"--out {{out}} {extra}"
    return Item(name, timeout, args, size=size, smoke=smoke, record=f"compare-{name}")


LLAMA = "--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --micro-batch-size 1 --steps 6"
LLAMA3_8B = (
    "--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --micro-batch-size 1 --steps 6"
)
MOE = "--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 1 --steps 6"


def _script(name: str, timeout: int, options: str, smoke: str, needs: tuple[str, ...] = ()) -> Item:
    return Item(
        name, timeout, f"benchmarks/{name}.py --device {{device}} {options}", smoke=smoke, record=name, needs=needs
    )


QUICK = "--quick --repeats 2"
ITEMS: list[Item] = [
    # the targets: llama level 1 >= 2.0x, level 2 >= 1.5x with peak <= 0.35x; llama-8B shape MFU >= 40%
    # (timeouts and steps from the first H100 run: a one-repeat llama compare of 6 steps took ~55 s wall)
    _compare("llama-level1", 100, "llama", 1, LLAMA, "--transformer-impl local"),
    _compare("llama-level2", 100, "llama", 2, LLAMA, "--transformer-impl local"),
    _compare("llama3-8b-level1", 100, "llama3", 1, LLAMA3_8B, "--transformer-impl local"),
    # reuse-fp32-param's step <= 1.1x megatron's Float16 step, bitwise
    _script("optimizer_step", 75, "", "--quick"),
    # moe level 1 >= 1.3x; moe, qwen3-moe and deepseek run on CUDA in both arms
    _compare("moe-level1", 80, "moe", 1, MOE),
    _compare("qwen3-moe-level1", 60, "qwen3-moe", 1, MOE.replace("--steps 6", "--steps 4")),
    _compare(
        "deepseek-level1",
        60,
        "deepseek",
        1,
        MOE.replace("--num-attention-heads 16", "--num-attention-heads 8").replace("--steps 6", "--steps 4"),
    ),
    # Megatron-LM pair: level 1 >= 1.5x, level 2 >= 1.2x with <= 0.4x max allocated
    _script("megatron_lm_pair", 150, "--train-iters 8 --timeout 60", "--quick --train-iters 4", ("MEGATRON_LM_PATH",)),
    # each fused op >= 1.0x Liger-Kernel's
    _script("fused_ops_rmsnorm", 45, "--repeats 20", QUICK),
    _script("fused_ops_swiglu", 45, "--repeats 20", QUICK),
    _script("fused_ops_rope", 45, "--repeats 20", QUICK),
    _script("attention", 45, "--repeats 20", QUICK + " --lengths 128"),
    _script(
        "linear_cross_entropy",
        60,
        "--tp 1 --tokens 4096 --dtype bfloat16 --repeats 5",
        "--quick --repeats 1 --vocabs 4096",
    ),
]


def _env(out: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MINDSPEED_LIKE_ARGS", None)
    env.update(MINDSPEED_LIKE_RESULTS=str(out), TORCHDYNAMO_DISABLE="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def run_item(item: Item, device: str, smoke: bool, out: Path, timeout: float) -> dict:
    missing = [name for name in item.needs if not os.environ.get(name)]
    if missing:
        return dict(item=item.name, status=f"skipped: set {', '.join(missing)}", seconds=0.0)
    command = [sys.executable, *item.command(device, smoke, out)]
    log = out / "logs" / f"{item.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as handle:
        handle.write(" ".join(command) + "\n")
        handle.flush()
        try:
            done = subprocess.run(
                command, stdout=handle, stderr=subprocess.STDOUT, env=_env(out), cwd=ROOT, timeout=timeout, check=False
            )
            status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            status = f"timed out ({timeout:.0f} s)"
    seconds = time.perf_counter() - start
    if status != "ok":
        tail = log.read_text(errors="replace").splitlines()[-25:]
        print(f"-- {item.name}: {status}; the log's tail ({log}):\n" + "\n".join(tail), flush=True)
    return dict(item=item.name, status=status, seconds=seconds, record=item.record_name(device, smoke))


def headline(out: Path, record: str) -> str:
    """The figures a reader looks for first, read back from the record."""
    path = out / f"{record}.json"
    if not record or not path.exists():
        return "(no record)"
    rec = json.loads(path.read_text())
    rows = rec.get("rows", [])
    if record.startswith("compare-"):
        by = {row.get("metric"): row for row in rows}
        parts = []
        for metric, label in (("tokens_per_s", "tokens/s"), ("process_peak_bytes", "peak")):
            if by.get(metric, {}).get("ratio") is not None:
                parts.append(f"{label} {by[metric]['ratio']:.2f}x")
        if by.get("mfu", {}).get("features") is not None:
            parts.append(f"MFU {by['mfu']['megatron']:.1%} -> {by['mfu']['features']:.1%}")
        peak = rec.get("extra", {}).get("peak_flops_per_s")
        if peak:
            parts.append(f"peak {peak / 1e12:.0f} TFLOP/s")
        return ", ".join(parts)
    keys = ("op", "case", "s", "dtype", "shape", "vocab", "arm", "speedup", "step_vs", "bitwise", "vs_liger")
    keys += ("time_ratio", "memory_ratio", "ms_per_iteration", "allocated_ratio", "status", "sdpa_flash_ms", "ours_ms")
    lines = []
    for row in rows:
        cells = [f"{key}={_short(row[key])}" for key in keys if key in row and row[key] not in (None, "-")]
        lines.append(" ".join(cells))
    return "\n      ".join(lines)


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--out", type=Path, default=None, help="records folder (default results/; --smoke: a temp folder)"
    )
    parser.add_argument("--device", default=None, help="the device every item runs on (default cuda; --smoke: cpu)")
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds for the whole set (default 480; --smoke: no limit)"
    )
    parser.add_argument("--smoke", action="store_true", help="every item at tiny sizes (a check that each runs)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these items only (names: --list)")
    parser.add_argument("--list", action="store_true", help="print the items (name, timeout, command) and exit")
    args = parser.parse_args(argv)
    if args.list:
        for item in ITEMS:
            print(f"{item.name:<22} {item.timeout:4d} s  {' '.join(item.command('cuda', False, Path('OUT')))}")
        return 0
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.budget = args.budget or (float("inf") if args.smoke else 480.0)
    out = args.out or (Path(tempfile.mkdtemp(prefix="bench-gpu-smoke-")) if args.smoke else ROOT / "results")
    out.mkdir(parents=True, exist_ok=True)
    unknown = set(args.only or ()) - {item.name for item in ITEMS}
    if unknown:
        parser.error(f"unknown item(s) {', '.join(sorted(unknown))}; known: {', '.join(i.name for i in ITEMS)}")
    chosen = [item for item in ITEMS if not args.only or item.name in args.only]
    print(
        f"bench-gpu: {len(chosen)} item(s) on {args.device}, records to {out}, budget {args.budget:.0f} s", flush=True
    )
    start = time.perf_counter()
    summary = []
    for item in chosen:
        left = args.budget - (time.perf_counter() - start)
        timeout = float(item.timeout) if not args.smoke else 600.0
        if left < min(30.0, timeout):
            summary.append(dict(item=item.name, status=f"skipped: budget spent ({args.budget:.0f} s)", seconds=0.0))
            continue
        print(
            f"== {item.name} (timeout {min(timeout, left):.0f} s, {time.perf_counter() - start:.0f} s so far)",
            flush=True,
        )
        summary.append(run_item(item, args.device, args.smoke, out, min(timeout, left)))
    total = time.perf_counter() - start
    print(f"\n== bench-gpu summary ({total:.0f} s; records in {out}, logs in {out / 'logs'})")
    for row in summary:
        try:
            figures = headline(out, row.get("record", ""))
        except Exception as error:  # the summary reads records back; a surprise in one must not hide the rest
            figures = f"(record unreadable: {type(error).__name__}: {error})"
        print(f"{row['item']:<22} {row['status']:<28} {row['seconds']:6.0f} s  {figures}")
    failed = [row for row in summary if row["status"] != "ok" and not row["status"].startswith("skipped: set")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
