"""Peak transient host memory of a function, from the PyTorch profiler's allocation events.

Every allocation and free PyTorch's CPU allocator makes inside the call is an event of the
profiler (``profile_memory=True``): an operator's own allocations are its
``self_cpu_memory_usage``; frees of tensors outside operators are ``[memory]`` events. Their
running sum, in start-time order, is the live extra memory; its maximum is the peak
workspace. Allocations freed inside one operator are not seen (they net out in that
operator), so this is the peak between operators: what a Python-level algorithm holds.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Largest number of bytes allocated (and not yet freed) at any moment during ``fn()``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    live = peak = 0
    for event in events:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak
