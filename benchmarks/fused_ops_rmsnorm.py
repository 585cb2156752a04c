"""RMSNorm forward+backward: megatron's torch.nn.RMSNorm (local spec) vs our fused module.

Both run in the same process on the same inputs; time is the median of ``--repeats`` fwd+bwd
passes (the two timed alternately, see ``_interleaved_ms``); saved bytes are what autograd keeps
for backward (saved-tensor hooks). Ours runs as configured (``--portable-kernels auto``:
compiled where the host can, i.e. unless TORCHDYNAMO_DISABLE is set); ``ours_eager_ms`` is the
eager portable kernel.

On a GPU (``--device cuda``) Liger-Kernel's Triton RMSNorm runs on the same tensors as the anchor
(``liger_ms``; ``vs_liger`` = Liger's time / ours, >= 1 when ours is at least as fast; the column
says why where Liger cannot run: benchmarks/liger_anchor.py), timed in the same alternation, and a
larger shape is added (a micro batch of 4 x 4096 tokens at Llama-8B's hidden size).

    python benchmarks/fused_ops_rmsnorm.py [--quick] [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import common  # benchmarks/ is the script directory (as in import_overhead.py)
import liger_anchor
import torch

from mindspeed_like.features.fused_rmsnorm import FusedRMSNorm
from mindspeed_like.kernels import compiled
from mindspeed_like.testing import SavedBytesMeter

MiB = 2**20


def _step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        x.grad = None
        module.weight.grad = None
        module(x).backward(grad)

    return step


def _liger_step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        x.grad = None
        module.weight.grad = None
        liger_anchor.rms_norm(x, module.weight, module.eps).backward(grad)

    return step


def _saved_mib(module: torch.nn.Module, x: torch.Tensor) -> float:
    with SavedBytesMeter() as meter:
        out = module(x)
    del out
    return meter.bytes / MiB


def _interleaved_ms(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median ms of each step, timed alternately so that load from other processes (this host is
    shared) hits all alike; on an accelerator each sample is the mean of a few calls between two
    device synchronisations. Each repeat's seconds go to the record under the step's label."""
    inner = common.calls_per_sample()
    for fn in steps.values():
        fn()
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in range(repeats):
        for label, fn in steps.items():
            common.sync()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            common.sync()
            times[label].append((time.perf_counter() - start) / inner)
    for label, seconds in times.items():
        common.add_samples(label, seconds)
    return {label: statistics.median(seconds) * 1e3 for label, seconds in times.items()}


def shapes(quick: bool) -> list[tuple[int, int]]:
    if quick:
        return [(1024, 1024)]
    return [(4096, 4096), (16384, 4096)] if common.on_accelerator() else [(4096, 4096)]


def run(args: argparse.Namespace, results: common.Results) -> None:
    device = common.device()
    liger_missing = liger_anchor.unavailable(device)
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, hidden in shapes(args.quick):
            torch.manual_seed(0)
            x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
            grad = torch.randn(tokens, hidden, dtype=dtype, device=device)
            megatron = torch.nn.RMSNorm(hidden, eps=1e-5, dtype=dtype, device=device)  # what WrappedTorchNorm builds
            ours = FusedRMSNorm(hidden, eps=1e-5, dtype=dtype, device=device)
            steps = {"megatron": _step(megatron, x, grad), "ours": _step(ours, x, grad)}
            missing = liger_missing or common.anchor_fails(_liger_step(ours, x, grad))
            if missing is None:
                steps["liger"] = _liger_step(ours, x, grad)
            with common.users_backend():
                ms = _interleaved_ms(steps, args.repeats)
                megatron_mib, ours_mib = _saved_mib(megatron, x), _saved_mib(ours, x)
                compiled.set_mode("eager")
                eager = _interleaved_ms({"megatron_2": steps["megatron"], "ours_eager": steps["ours"]}, args.repeats)
                compiled.set_mode(None)
            results.add(
                op="rmsnorm",
                dtype=str(dtype).removeprefix("torch."),
                shape=f"{tokens}x{hidden}",
                megatron_ms=ms["megatron"],
                ours_ms=ms["ours"],
                ours_eager_ms=eager["ours_eager"],
                speedup=ms["megatron"] / ms["ours"],
                **common.anchor_columns("liger", ms.get("liger"), ms["ours"], missing),
                megatron_saved_MiB=megatron_mib,
                ours_saved_MiB=ours_mib,
            )


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    results = common.Results("fused_ops_rmsnorm")
    run(args, results)
    results.print_table()
    results.write_json(args.json)


if __name__ == "__main__":
    main()
