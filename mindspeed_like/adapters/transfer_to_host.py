"""The transfer-to-host feature (``--transfer-to-host``): a client's own CUDA calls, on a CPU host.

The cpu-adapter changes megatron's call sites, never torch: it cannot reach a client's code. A
client that moves its modules itself, e.g. mbridge (verl's default Megatron<->HF bridge) whose own
copy of megatron's ``get_model`` does ``model_module.cuda(torch.cuda.current_device())``, dies on a
CPU-only torch with ``AssertionError: Torch not compiled with CUDA enabled`` (issue 37 item 9a).
ms-swift's ``megatron sft`` and mcore-bridge spell CUDA in many more ways (issue 55 item 3):
``torch.cuda.Stream()`` / ``current_stream()`` / ``stream(...)`` around its DDP wrapping,
``torch.tensor(..., device='cuda')`` flags exchanged between pipeline ranks, ``tensor.to('cuda')``,
``torch.cuda.device_count() > 0`` as the gate in front of megatron's
``model_parallel_cuda_manual_seed`` (skipped, the TP=2 run then fails "cuda rng state
model-parallel-rng is not added"), ``torch.cuda.get_rng_state()`` in its checkpoints and
``torch.cuda.max_memory_reserved()`` in its log line.

This opt-in flag covers them the way torch_npu's ``transfer_to_npu`` covers CUDA code on an NPU
(the same spelling, hence the name), in two scopes, chosen by where the spelling can be reached:

Process-wide (declared global changes, each in the patch report): the spellings that are methods
of tensors and modules, or device strings handed from one module to another (ms-swift's
``to_device(batch, 'cuda')`` ends in ``swift.utils``, a batch's ``.to('cuda')`` in transformers),
so no module-level view can catch them:

* ``torch.Tensor.cuda`` / ``torch.nn.Module.cuda``: the object itself, unmoved (any arguments);
* ``torch.Tensor.to`` / ``torch.nn.Module.to``: a CUDA device argument (``'cuda'``, ``'cuda:N'``,
  an index, a cuda ``torch.device``) reads as the host; every other call is torch's own. On a
  CPU-only torch such a call can only raise, so no working program changes. torch.compile does not
  see the wrap (dynamo dispatches tensor methods by name), checked by a test;
* ``torch.cuda.current_device()``: ``torch.device("cpu")`` (an index would name a CUDA device to
  ``.to(...)`` and ``device=``; clients pass it to both), ``torch.cuda.set_device``: nothing to
  select, ``torch.cuda.synchronize``: nothing to wait for.

Per client module (:data:`CLIENT_PACKAGES`): every module of those packages whose source spells
``cuda`` gets :data:`CLIENT_HOST_TORCH` as its module global ``torch`` when it is imported (or now,
if it already is), as cpu-training-loop does for megatron.training's modules. Through that name
the client's ``torch.cuda.*`` (streams and events, RNG state and seeding on the host generator,
``device_count() == 1``, memory statistics as the process's resident memory), its factories'
``device='cuda'`` and its ``torch.device('cuda:N')`` act on the host. No other module sees it:
torch's and ours keep the real torch, so ``torch.cuda.is_available()`` stays False everywhere
(torch.compile, megatron's ``jit_fuser``, breaks when it lies; a client's own
``if torch.cuda.is_available()`` then takes its host branch, which is what a CPU run needs).

Each change is said once when switched on, and undone by ``configure(transfer_to_host=False)`` or
``mindspeed_like.reset()``. Not covered: a CUDA spelling in a client package not listed below, a
client's own compiled kernels (triton, CUDA extensions), ``tensor.is_cuda`` (False: the tensor is
on the host), CUDA graphs.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from typing import Any

import torch

from mindspeed_like.adapters.cpu.host_view import HostTorch
from mindspeed_like.adapters.cpu_training.host_training import _FACTORIES, TrainingHostCuda, _on_host
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.errors import ConfigError

logger = logging.getLogger("mindspeed_like")

NAME = "transfer-to-host"
_HOST = torch.device("cpu")
CLIENT_PACKAGES = ("swift.megatron", "mcore_bridge")
"""The client packages whose own modules get the host view of torch: ms-swift's megatron side
(``megatron sft``; the rest of ms-swift asks transformers' ``is_torch_cuda_available()`` and takes
its host branch already) and mcore-bridge (its Megatron<->HF bridge). mbridge (verl) needs only the
process-wide part."""
SAID = (
    "transfer-to-host is on for the whole process: Tensor.cuda() and Module.cuda() leave their object on the host, "
    "Tensor.to()/Module.to() read a CUDA device as the host, torch.cuda.current_device() is the CPU, "
    "torch.cuda.set_device/synchronize do nothing; the modules of " + ", ".join(CLIENT_PACKAGES) + " that spell "
    "cuda see a host view of torch (configure(transfer_to_host=False) or mindspeed_like.reset() undoes it)"
)
_said = False


def stay(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Tensor.cuda`` / ``Module.cuda``: the object itself (called through the class: its first argument).

    Except a tensor whose elements share memory (an ``expand()``ed view): the copy to a GPU
    materializes it, so code writes into the result row by row (Megatron-LM's LLaVA test builds its
    ``input_ids`` as ``arange(n).expand(5, n).cuda()`` and sets one token per row); left as the
    view, every write would land in every row. It gets a dense copy, as on a GPU."""
    obj = instance if instance is not None else args[0]
    if isinstance(obj, torch.Tensor) and torch._debug_has_internal_overlap(obj) == 1:  # MemOverlap::Yes
        return obj.clone(memory_format=torch.contiguous_format)
    return obj


def _is_cuda(device: Any) -> bool:
    """'cuda', 'cuda:N', an index (a CUDA device to ``.to()`` and ``torch.device``) or a cuda torch.device."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return True
    return isinstance(device, torch.device) and device.type == "cuda"


def to_host(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Tensor.to`` / ``Module.to``: a CUDA device argument, positional (first) or ``device=``, reads
    as the host; ``.to(dtype)``, ``.to(other)``, ``.to('cpu')`` are torch's own calls unchanged.

    Called through the class (``torch.Tensor.to(x, 'cuda')``) the object is ``args[0]`` and the
    device the second argument."""
    first = 0 if instance is not None else 1
    if len(args) > first and _is_cuda(args[first]):
        args = (*args[:first], _HOST, *args[first + 1 :])
    if "device" in kwargs and _is_cuda(kwargs["device"]):
        kwargs = {**kwargs, "device": _HOST}
    return wrapped(*args, **kwargs)


def current_device() -> torch.device:
    return _HOST


def set_device(device: Any) -> None:
    pass


def synchronize(device: Any = None) -> None:
    pass


class _HostDeviceType(type):
    """``isinstance(x, torch.device)`` in a client module keeps meaning a torch device."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.device)

    def __call__(cls, *args: Any, **kwargs: Any) -> torch.device:
        if args and _is_cuda(args[0]):
            return _HOST
        if "type" in kwargs and _is_cuda(kwargs["type"]):
            return _HOST
        return torch.device(*args, **kwargs)


class HostDevice(metaclass=_HostDeviceType):
    """``torch.device`` as a client module sees it: ``torch.device('cuda:1')`` is the host."""


CLIENT_HOST_TORCH = HostTorch(**{name: _on_host(getattr(torch, name)) for name in _FACTORIES}, device=HostDevice)
CLIENT_HOST_TORCH.cuda = TrainingHostCuda()


@functools.cache
def client_modules(packages: tuple[str, ...] = CLIENT_PACKAGES) -> tuple[str, ...]:
    """The modules of ``packages`` whose source spells ``cuda`` and imports torch, found on disk
    without importing anything (a package not installed has none; a subpackage is looked up under
    its top-level package's folder, since ``find_spec`` of a dotted name imports its parent)."""
    found: list[str] = []
    for package in packages:
        top, *below = package.split(".")
        spec = importlib.util.find_spec(top)  # a top-level name: found, not imported
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in (os.path.join(location, *below) for location in spec.submodule_search_locations):
            for folder, dirs, files in os.walk(root):
                dirs[:] = sorted(d for d in dirs if d.isidentifier())
                parts = os.path.relpath(folder, root).split(os.sep)
                prefix = ".".join([package, *(p for p in parts if p != ".")])
                for file in sorted(files):
                    if not file.endswith(".py"):
                        continue
                    with open(os.path.join(folder, file), encoding="utf-8", errors="replace") as handle:
                        text = handle.read()
                    if "cuda" in text and "torch" in text:
                        found.append(prefix if file == "__init__.py" else f"{prefix}.{file[:-3]}")
    return tuple(found)


def _global(target: str, kind: Kind, new: Any, why: str, **order: Any) -> Patch:
    return Patch(target, kind, new, global_change=True, why=why, **order)


PROCESS_WIDE = [
    # the cpu-training-loop wraps these two as well (identity inside its host regions only): ours
    # sits above it and answers everywhere
    _global(
        "torch.Tensor.cuda",
        Kind.WRAP,
        stay,
        "a client's .cuda(): the tensor stays on the host",
        after=("cpu-training-loop",),
    ),
    _global(
        "torch.nn.Module.cuda",
        Kind.WRAP,
        stay,
        "a client's .cuda(): the module stays on the host",
        after=("cpu-training-loop",),
    ),
    _global("torch.Tensor.to", Kind.WRAP, to_host, "a client's .to('cuda'): the host"),
    _global("torch.nn.Module.to", Kind.WRAP, to_host, "a client's .to('cuda'): the host"),
    _global("torch.cuda.current_device", Kind.REPLACE, current_device, "the device clients place on: the CPU"),
    _global("torch.cuda.set_device", Kind.REPLACE, set_device, "one host device: nothing to select"),
    _global("torch.cuda.synchronize", Kind.REPLACE, synchronize, "host work runs in program order"),
]


def patches(ctx: Context) -> list[Patch]:
    """The process-wide patches, and one module-local ``torch`` per client module (see the module
    docstring); a client module that binds no ``torch`` is an optional skip."""
    return [
        *PROCESS_WIDE,
        *(
            Patch(
                f"{name}.torch",
                Kind.REPLACE,
                CLIENT_HOST_TORCH,
                optional=True,
                module=name,
                update_aliases=False,
                global_change=True,
                why="client module's view of torch: torch.cuda.*, device='cuda', torch.device('cuda:N') on the host",
            )
            for name in client_modules(CLIENT_PACKAGES)
        ),
    ]


def _validate(ctx: Context) -> None:
    if ctx.device != "cpu":
        raise ConfigError(
            f"--transfer-to-host is for a CPU host (it makes .cuda() leave objects on the host); the device here is "
            f"{ctx.device!r}, where .cuda() is right. Drop --transfer-to-host."
        )


def _say_once(ctx: Context) -> None:
    global _said
    if not _said:
        _said = True
        logger.warning("mindspeed_like: %s", SAID)


FEATURE = Feature(
    name=NAME,
    summary="a client's own CUDA calls (.cuda(), .to('cuda'), torch.cuda.*, device='cuda') on the CPU host (opt-in)",
    patches=patches,
    flags=(
        Flag(
            "transfer_to_host",
            bool,
            False,
            "on a CPU host, make a client's own .cuda(), .to('cuda') and torch.cuda.current_device()/set_device/"
            "synchronize act on the host for the whole process (like torch_npu's transfer_to_npu for an NPU), and give "
            "ms-swift's and mcore-bridge's modules a host view of torch (streams, RNG, device_count, memory, "
            "device='cuda'). Declared global changes, reversible",
        ),
    ),
    requires=("cpu-adapter",),
    validate=_validate,
    activate=_say_once,
    backend="cpu",
    kind="adapter",
    switch_on={"transfer_to_host": True},
)
