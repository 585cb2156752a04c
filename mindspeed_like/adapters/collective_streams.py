"""collective-streams: an accelerator's collectives free their buffers when the compute stream is
done with them, not when the collective's stream catches up (issue 54 item 7).

The trap: a process group that runs a collective on its own stream used to call the caching
allocator's ``recordStream`` on the collective's tensors, so a buffer freed on the compute stream
stays reserved until the collective's stream passes an event recorded at free time; with the host
running ahead, every layer's all-gather buffer of TP + FSDP2 stays alive (torchtitan measured peak
active memory 39 -> 18 GB on 8 GPUs with ``TORCH_NCCL_AVOID_RECORD_STREAMS=1``). What each stack does
by default:

* torch >= 2.8, NCCL (``ProcessGroupNCCL``): no ``recordStream`` at all. pytorch/pytorch#148590 ("Launch
  kernel on current stream & remove record_stream entirely", kept out of 2.7 by #150352, landed for
  the next release) launches ``async_op=False`` collectives on the current stream and keeps the tensors
  of ``async_op=True`` ones alive by stashing references (``WorkNCCL::stashed_for_allocator_safety_``, a
  ``TensorShelf``, in torch 2.13's ``ProcessGroupNCCL.hpp``) until ``wait()``. Setting the variable only
  prints "TORCH_NCCL_AVOID_RECORD_STREAMS is the default now, this environment variable is thus
  deprecated". Nothing to set.
* torch 2.6 / 2.7, NCCL: ``recordStream`` unless ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` (read when a
  ``ProcessGroupNCCL`` is constructed): set here, before any process group exists, unless you set it.
* torch_npu, HCCL: ``MULTI_STREAM_MEMORY_REUSE`` (default 1 in torch_npu's environment-variable
  reference) erases the ``recordStream`` marks at ``work.wait()``, so a freed buffer returns to the
  pool then; 2 (what MindSpeed-MM's FSDP2 recipes export) stashes strong references instead, which
  torch_npu's reference does not recommend yet. The default already avoids the trap: nothing set.
* CPU (gloo): no streams, nothing to record: the trap cannot arise.

A variable you set yourself is never changed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from packaging.version import Version

from mindspeed_like.toolkit.declaration import Context, Feature

NAME = "collective-streams"
NCCL_VARIABLE = "TORCH_NCCL_AVOID_RECORD_STREAMS"
HCCL_VARIABLE = "MULTI_STREAM_MEMORY_REUSE"
NCCL_STASHES_FROM = Version("2.8")


@dataclass(frozen=True)
class Decision:
    """What to set in the environment (``sets``; empty: nothing) and the report's line."""

    sets: dict[str, str] = field(default_factory=dict)
    line: str = ""


def decide(device: str, torch_version: str, environ: Mapping[str, str]) -> Decision:
    """The environment this host's process groups need so that collectives do not pin freed buffers."""
    if device == "cuda":
        torch_release = Version(Version(torch_version).base_version)
        if torch_release >= NCCL_STASHES_FROM:
            return Decision(
                line=f"collective buffers: torch {torch_version}'s ProcessGroupNCCL stashes tensors instead of "
                f"recordStream (torch >= 2.8); {NCCL_VARIABLE} is not needed (deprecated there)"
            )
        if NCCL_VARIABLE in environ:
            return Decision(line=f"collective buffers: {NCCL_VARIABLE}={environ[NCCL_VARIABLE]}, set by you: kept")
        return Decision(
            sets={NCCL_VARIABLE: "1"},
            line=f"collective buffers: {NCCL_VARIABLE}=1 set by mindspeed_like (torch {torch_version} < 2.8 calls "
            "recordStream on collective tensors: freed all-gather buffers stay reserved until NCCL's stream "
            "catches up)",
        )
    if device == "npu":
        if HCCL_VARIABLE in environ:
            return Decision(line=f"collective buffers: {HCCL_VARIABLE}={environ[HCCL_VARIABLE]}, set by you: kept")
        return Decision(
            line=f"collective buffers: torch_npu's default {HCCL_VARIABLE}=1 erases HCCL's recordStream marks at "
            "work.wait(); nothing set"
        )
    return Decision(line="collective buffers: gloo on the host has no streams; nothing to set")


def apply(device: str, environ: MutableMapping[str, str] | None = None) -> Decision:
    """Set what :func:`decide` says in ``environ`` (the process's); before any process group exists."""
    import torch

    environ = os.environ if environ is None else environ
    decision = decide(device, torch.__version__, environ)
    for name, value in decision.sets.items():
        environ.setdefault(name, value)
    return decision


def _activate(ctx: Context) -> None:
    apply(ctx.device)


def describe(device: str) -> str:
    """The line ``mindspeed-like report`` prints on an accelerator."""
    import torch

    return decide(device, torch.__version__, os.environ).line


FEATURE = Feature(
    name=NAME,
    summary="on CUDA with torch < 2.8: TORCH_NCCL_AVOID_RECORD_STREAMS=1 before the process groups exist, unless "
    "set (declared global change); torch >= 2.8 and torch_npu's default need nothing",
    activate=_activate,
    enabled=lambda ctx: ctx.device in ("cuda", "npu"),
    backend="any",
    switched_by="--device cuda / npu",
    kind="adapter",
)

__all__ = ["FEATURE", "NAME", "Decision", "apply", "decide", "describe"]
