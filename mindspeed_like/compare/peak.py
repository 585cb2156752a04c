"""The device's bf16 matmul peak, measured: what model FLOP utilisation is a fraction of.

Not a datasheet number: one large square bf16 GEMM (8192^3 by default: 1.1 TFLOP a call, far past
the size where an H100's tensor cores saturate), a few untimed calls first (cuBLAS picks its
kernel, clocks ramp up), then the median over ``repeats`` samples of ``calls`` back-to-back calls
between two device synchronisations. On an H100 SXM this gives ~750-800 TFLOP/s (the datasheet's
dense bf16 figure is 989). Measured once per `compare` run, in its parent process before the arms
start, so both arms are divided by the same number from the same run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

ACCELERATORS = ("cuda", "npu")


def bf16_matmul_peak(
    device: str, size: int = 8192, repeats: int = 7, calls: int = 10, warmup: int = 5
) -> dict[str, Any]:
    """FLOP/s of a ``size``^3 bf16 matmul on ``device`` (an accelerator), with how it was measured."""
    if device not in ACCELERATORS:
        raise ValueError(f"a matmul peak is measured on an accelerator ({', '.join(ACCELERATORS)}), not {device!r}")
    module = getattr(torch, device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=torch.bfloat16)
    out = torch.empty(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    samples = []
    for _ in range(repeats):
        module.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            torch.matmul(a, b, out=out)
        module.synchronize()
        samples.append((time.perf_counter() - start) / calls)
    del a, b, out
    module.empty_cache()
    seconds = statistics.median(samples)
    return {
        "flops_per_s": 2.0 * size**3 / seconds,
        "how": f"{size}^3 bf16 matmul, median of {repeats} samples of {calls} calls after {warmup} untimed",
        "seconds_per_call": samples,
    }
