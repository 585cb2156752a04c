"""What one training run is measured by: exact bytes per kind of state, and step times.

Bytes are distinct tensor storages (deduplicated by data pointer, so a master that shares its
storage with the weight, as reuse-fp32-param arranges, counts once, under weights); activations
are the bytes autograd holds for backward right after a forward (``SavedBytesMeter``), parameters
and masters excluded. The process peak is the OS's (CPU: peak RSS, runtime included) or the
device allocator's.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from mindspeed_like.testing.memory import SavedBytesMeter


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    out: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            out[storage.data_ptr()] = max(out.get(storage.data_ptr(), 0), storage.nbytes())
    return out


def _inner_optimizers(optimizer) -> list:
    """megatron's optimizer, unchained: each member of a ChainedOptimizer, or itself."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Every tensor the optimizer holds: the inner torch optimizer's params (fp32 masters) and
    state (moments, remainders), and megatron's master groups."""
    for member in _inner_optimizers(optimizer):
        inner = getattr(member, "optimizer", None)
        if inner is not None:
            for group in inner.param_groups:
                yield from group["params"]
            for state in inner.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups", "shard_fp32_groups"):
            for group in getattr(member, name, None) or []:
                yield from (t for t in group if isinstance(t, torch.Tensor))


def state_bytes(model: torch.nn.Module | Sequence[torch.nn.Module], optimizer) -> dict[str, int]:
    """Weights, gradients and optimizer state in bytes; each storage counted once, in the first
    of those kinds that holds it. ``model``: a model or the chunks of a virtual pipeline (one
    optimizer over all of them)."""
    models = [model] if isinstance(model, torch.nn.Module) else list(model)
    params = [p for m in models for p in m.parameters()]
    weights = _storages(params)
    grads = _storages(
        t for p in params for t in (getattr(p, "main_grad", None), p.grad, getattr(p, "decoupled_grad", None))
    )
    grads = {k: v for k, v in grads.items() if k not in weights}
    state = {k: v for k, v in _storages(_optimizer_tensors(optimizer)).items() if k not in weights and k not in grads}
    return {"weights": sum(weights.values()), "gradients": sum(grads.values()), "optimizer": sum(state.values())}


@dataclass
class ActivationProbe:
    """Measures the bytes saved for backward by one step's forward (the step given), excluding
    the parameters and the optimizer's masters (held all run anyway)."""

    step: int
    exclude: list[torch.Tensor] = field(default_factory=list)
    bytes: int = 0

    @contextlib.contextmanager
    def __call__(self, step: int):
        if step != self.step:
            yield
            return
        with SavedBytesMeter() as meter:
            yield
        self.bytes = meter.current_bytes(exclude=self.exclude)
        meter.release()  # else the step's backward frees no activation until it ends


def process_peak_bytes(device: str) -> int:
    """The process's peak memory: the device allocator's peak on an accelerator, else peak RSS."""
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    if device == "npu":
        return int(torch.npu.max_memory_allocated())  # type: ignore[attr-defined]
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # kB on Linux


def step_time_summary(times: list[float]) -> dict[str, float]:
    """Median and spread of the step times, the first step (allocation, warm-up) left out when
    there are at least three."""
    steady = times[1:] if len(times) >= 3 else list(times)
    return {
        "median_s": statistics.median(steady),
        "min_s": min(steady),
        "max_s": max(steady),
        "first_s": times[0],
        "steps_timed": len(steady),
    }
