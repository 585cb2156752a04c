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
import types
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from mindspeed_like.toolkit.dtensors import local_shard
from mindspeed_like.workloads.memory import SavedBytesMeter


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    out: dict[int, int] = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        tensor = local_shard(tensor)
        if tensor.device.type == "meta":
            continue
        try:
            storage = tensor.untyped_storage()
            pointer, size = storage.data_ptr(), storage.nbytes()
        except RuntimeError:
            # a storage freed in place: FSDP's unsharded parameters between steps (resharded) hold none
            continue
        if size:
            out[pointer] = max(out.get(pointer, 0), size)
    return out


# What holds no state of a run (a class, a module, a function) and what is measured as its own
# kind (the model's modules: weights and gradients), where the walk below stops.
_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size)
_STOP = (torch.nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """Every tensor megatron's optimizer keeps alive, found by walking its object graph: the
    attributes of every object it reaches (``__dict__`` and ``__slots__``), the items of its
    containers (dict keys and values), the attributes set on tensors. That is the inner torch
    optimizers' params (fp32 masters) and state (moments), megatron's master groups and flags
    (``found_inf``), and whatever a feature keeps on them under its own name (reuse-fp32-param's
    int16 residual shards beside the DistributedOptimizer's bf16 buffer), without a list of names
    to keep up to date. The walk stops at ``torch.nn.Module`` (the model chunks the optimizer
    refers to: their parameters and gradients are counted as weights and gradients; storages are
    deduplicated against those kinds in :func:`state_bytes`) and at classes, modules and functions."""
    seen: set[int] = set()
    stack: list = [optimizer]
    while stack:
        obj = stack.pop()
        if isinstance(obj, _LEAVES) or isinstance(obj, _STOP) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
            stack.extend(getattr(obj, "__dict__", {}).values())  # e.g. main_grad on a master
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            stack.extend(getattr(obj, "__dict__", {}).values())
            for cls in type(obj).__mro__:
                slots = getattr(cls, "__slots__", ())
                for slot in (slots,) if isinstance(slots, str) else slots:
                    if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                        stack.append(getattr(obj, slot))


def _megatron_fsdp_buffer_roles() -> dict[str, str]:
    """Megatron-FSDP keeps a model's state in per-parameter-group ``DataParallelBuffer``s, not in
    the module's parameters (resharded, they hold no storage between steps): which kind each
    buffer field of the installed release's ``ParameterGroup`` is. A field this table does not
    know counts as weights, and tests/compare checks the table against the installed release."""
    try:
        import dataclasses

        from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import ParameterGroup
    except ImportError:
        return {}
    # HSDP's gradient buffers: 0.16's hsdp_gbuf (persistent, the instance's shard), 0.19's hfsdp_helper_gbuf (the
    # same role, renamed) and hsdp_comm_gbuf (a temporary bucket for the outer reduction)
    roles = {
        "main_weight_buffer": "optimizer",
        "main_grad_buffer": "gradients",
        "hsdp_gbuf": "gradients",
        "hfsdp_helper_gbuf": "gradients",
        "hsdp_comm_gbuf": "gradients",
    }
    return {
        field.name: roles.get(field.name, "weights")
        for field in dataclasses.fields(ParameterGroup)
        if "DataParallelBuffer" in str(field.type)
    }


def _megatron_fsdp_gathered(params: Sequence[torch.Tensor], role: dict[int, str]) -> set[int]:
    """The storages of Megatron-FSDP's gathered units: a DTensor parameter's ``orig_param`` (the module's
    own parameter) whose storage is none of the buffers is an all-gathered bucket, what ``mindspeed-like
    plan`` counts as "FSDP: unsharded units in flight", not model state. megatron-core 0.16.1 has freed them
    when the step starts; 0.19.2 keeps the unit outside Megatron-FSDP's units (embedding, output layer,
    final norm) gathered from the first forward on, and the optimizer walk reached it through
    ``orig_param`` and counted it as optimizer state."""
    originals = [getattr(p, "orig_param", None) for p in params]
    return {pointer for pointer in _storages(t for t in originals if t is not None) if pointer not in role}


def _data_parallel_buffers(models: Sequence[torch.nn.Module]) -> dict[str, list[torch.Tensor]]:
    """The tensors of Megatron-FSDP's buffers, by kind (empty for DDP and torch FSDP2, whose
    state is the parameters' own storages or their DTensor shards).

    A parameter group without a ``model_weight_buffer`` (``no_shard``: megatron-core builds one for every
    other strategy) keeps its training weights in the module's own parameters, the group's ``params``; during
    a step the module holds DTensors of the fp32 main-weight buffer instead, and the originals are reached only
    through ``orig_param``, where :func:`_megatron_fsdp_gathered` would take them for a gathered unit. They are
    this group's weights (0.19.2, llama DP 2 ``no_shard``: 15 bf16 parameters, 3,082,752 bytes a rank, which
    compare read as 0 before)."""
    out: dict[str, list[torch.Tensor]] = {"weights": [], "gradients": [], "optimizer": []}
    roles = _megatron_fsdp_buffer_roles()
    for model in models:
        buffer = getattr(model, "param_and_grad_buffer", None)
        for group in getattr(buffer, "parameter_groups", None) or ():
            for name, kind in roles.items():
                data = getattr(getattr(group, name, None), "data", None)
                if isinstance(data, torch.Tensor):
                    out[kind].append(data)
            if "model_weight_buffer" in roles and getattr(group, "model_weight_buffer", None) is None:
                out["weights"].extend(p for p in getattr(group, "params", None) or () if isinstance(p, torch.Tensor))
    return out


def state_bytes(model: torch.nn.Module | Sequence[torch.nn.Module], optimizer) -> dict[str, int]:
    """Weights, gradients and optimizer state in bytes; each storage counted once, in the first
    of those kinds that holds it. ``model``: a model or the chunks of a virtual pipeline (one
    optimizer over all of them). Sharded data parallelism counts this rank's shards: DTensor
    parameters by their local shard, Megatron-FSDP's buffers by their kind, which wins over where
    a tensor is found (during a step Megatron-FSDP's module parameters are views of its fp32 master
    shard: optimizer state, not weights). Megatron-FSDP's gathered units are no kind of state (see
    :func:`_megatron_fsdp_gathered`)."""
    models = [model] if isinstance(model, torch.nn.Module) else list(model)
    params = [p for m in models for p in m.parameters()]
    buffers = _data_parallel_buffers(models)
    role = {pointer: kind for kind, tensors in buffers.items() for pointer in _storages(tensors)}
    gathered = _megatron_fsdp_gathered(params, role)

    def of_kind(kind: str, found: dict[int, int]) -> dict[int, int]:
        return {k: v for k, v in found.items() if role.get(k, kind) == kind}

    weights = of_kind("weights", _storages([*params, *buffers["weights"]]))
    grads = _storages(
        [
            *(t for p in params for t in (getattr(p, "main_grad", None), p.grad, getattr(p, "decoupled_grad", None))),
            *buffers["gradients"],
        ]
    )
    grads = {k: v for k, v in of_kind("gradients", grads).items() if k not in weights}
    state = {
        k: v
        for k, v in _storages([*_optimizer_tensors(optimizer), *buffers["optimizer"]]).items()
        if k not in weights and k not in grads and k not in gathered
    }
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
