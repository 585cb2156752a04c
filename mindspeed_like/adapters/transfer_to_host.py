"""The transfer-to-host feature (``--transfer-to-host``): a client's own ``.cuda()`` calls, on a CPU host.

The cpu-adapter changes megatron's call sites, never torch: it cannot reach a client's code. A
client that moves its modules itself, e.g. mbridge (verl's default Megatron<->HF bridge) whose own
copy of megatron's ``get_model`` does ``model_module.cuda(torch.cuda.current_device())``, dies on a
CPU-only torch with ``AssertionError: Torch not compiled with CUDA enabled`` (issue 37 item 9a).

For such a client this opt-in flag changes torch for the whole process, the way torch_npu's
``transfer_to_npu`` does for an NPU (the same spelling, hence the name): ``.cuda()`` transfers
to the host, i.e. leaves tensors and modules where they are, and ``torch.cuda``'s device calls
answer for the host:

* ``torch.Tensor.cuda`` / ``torch.nn.Module.cuda``: the object itself, unmoved (any arguments);
* ``torch.cuda.current_device()``: ``torch.device("cpu")`` (an index would name a CUDA device to
  ``.to(...)`` and ``device=``; clients pass it to both), ``torch.cuda.set_device``: nothing to
  select, ``torch.cuda.synchronize``: nothing to wait for.

``torch.cuda.is_available()`` stays False (torch.compile, megatron's ``jit_fuser``, breaks when
it lies). Each change is a declared global change (the patch report lists them), said once when
switched on, and undone by ``configure(transfer_to_host=False)`` or ``mindspeed_like.reset()``.
Not covered: ``device='cuda'`` given to torch's factories by the client, CUDA streams and events
in the client's code (the cpu-adapter covers megatron's own).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.errors import ConfigError

logger = logging.getLogger("mindspeed_like")

NAME = "transfer-to-host"
_HOST = torch.device("cpu")
SAID = (
    "transfer-to-host is on for the whole process: Tensor.cuda() and Module.cuda() leave their object on the host, "
    "torch.cuda.current_device() is the CPU, torch.cuda.set_device/synchronize do nothing "
    "(configure(transfer_to_host=False) or mindspeed_like.reset() undoes it)"
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


def current_device() -> torch.device:
    return _HOST


def set_device(device: Any) -> None:
    pass


def synchronize(device: Any = None) -> None:
    pass


def _global(target: str, kind: Kind, new: Any, why: str, **order: Any) -> Patch:
    return Patch(target, kind, new, global_change=True, why=why, **order)


PATCHES = [
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
    _global("torch.cuda.current_device", Kind.REPLACE, current_device, "the device clients place on: the CPU"),
    _global("torch.cuda.set_device", Kind.REPLACE, set_device, "one host device: nothing to select"),
    _global("torch.cuda.synchronize", Kind.REPLACE, synchronize, "host work runs in program order"),
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
    summary="a client's .cuda() / torch.cuda device calls served by the CPU host, process-wide (opt-in)",
    patches=PATCHES,
    flags=(
        Flag(
            "transfer_to_host",
            bool,
            False,
            "on a CPU host, make a client's own .cuda() and torch.cuda.current_device()/set_device/synchronize "
            "act on the host for the whole process (like torch_npu's transfer_to_npu for an NPU); for clients "
            "such as mbridge that move their modules themselves. Declared global change, reversible",
        ),
    ),
    requires=("cpu-adapter",),
    validate=_validate,
    activate=_say_once,
    backend="cpu",
    kind="adapter",
    switch_on={"transfer_to_host": True},
)
