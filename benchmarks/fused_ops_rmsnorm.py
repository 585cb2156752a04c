"""RMSNorm forward+backward: megatron's torch.nn.RMSNorm (local spec) vs our fused module.

Both run in the same process on the same inputs; time is the median of ``--repeats`` fwd+bwd
passes (the two timed alternately, see ``_interleaved_ms``); saved bytes are what autograd keeps
for backward (saved-tensor hooks). Ours runs as configured (``--portable-kernels auto``:
compiled where the host can, i.e. unless TORCHDYNAMO_DISABLE is set); ``ours_eager_ms`` is the
eager portable kernel.

    python benchmarks/fused_ops_rmsnorm.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import common  # benchmarks/ is the script directory (as in import_overhead.py)
import torch

from mindspeed_like.features.fused_rmsnorm import FusedRMSNorm
from mindspeed_like.kernels import compiled
from mindspeed_like.kernels.backend import force_backend
from mindspeed_like.testing import SavedBytesMeter

MiB = 2**20


def _step(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        x.grad = None
        module.weight.grad = None
        module(x).backward(grad)

    return step


def _saved_mib(module: torch.nn.Module, x: torch.Tensor) -> float:
    with SavedBytesMeter() as meter:
        out = module(x)
    del out
    return meter.bytes / MiB


def _interleaved_ms(
    first: Callable[[], None], second: Callable[[], None], repeats: int, labels: tuple[str, str]
) -> tuple[float, float]:
    """Median ms of each, timed alternately so that load from other processes (this host is
    shared) hits both alike. Each repeat's seconds go to the record under ``labels``."""
    first()
    second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, sink in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - start)
    common.add_samples(f"{labels[0]}", times[0])
    common.add_samples(f"{labels[1]}", times[1])
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def run(args: argparse.Namespace, results: common.Results) -> None:
    shapes = [(1024, 1024)] if args.quick else [(4096, 4096)]
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, hidden in shapes:
            torch.manual_seed(0)
            x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
            grad = torch.randn(tokens, hidden, dtype=dtype)
            megatron = torch.nn.RMSNorm(hidden, eps=1e-5, dtype=dtype)  # what WrappedTorchNorm builds
            ours = FusedRMSNorm(hidden, eps=1e-5, dtype=dtype)
            with force_backend("portable"):
                megatron_ms, ours_ms = _interleaved_ms(
                    _step(megatron, x, grad), _step(ours, x, grad), args.repeats, ("megatron", "ours")
                )
                megatron_mib, ours_mib = _saved_mib(megatron, x), _saved_mib(ours, x)
                compiled.set_mode("eager")
                _, eager_ms = _interleaved_ms(
                    _step(megatron, x, grad), _step(ours, x, grad), args.repeats, ("megatron_2", "ours_eager")
                )
                compiled.set_mode(None)
            results.add(
                op="rmsnorm",
                dtype=str(dtype).removeprefix("torch."),
                shape=f"{tokens}x{hidden}",
                megatron_ms=megatron_ms,
                ours_ms=ours_ms,
                ours_eager_ms=eager_ms,
                speedup=megatron_ms / ours_ms,
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
