"""host-allocator (``--tune-host-allocator``): on a CPU host, glibc malloc keeps the blocks a
training step frees for the next step instead of unmapping them, so a step stops paying for fresh
pages (page faults, system time). Process-wide and numerics-free; see ``glibc.py`` for why and
what is set. No patches: ``activate`` sets it; switching the feature off (or ``reset()``) gives
glibc mmap back, with the thresholds its own adaptation settles at, and trims the heap."""

from __future__ import annotations

import logging

from mindspeed_like.features.host_allocator import glibc
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.fallback import Fallback

NAME = "host-allocator"
_tuned = False


def _cannot_act(ctx: Context) -> str | None:
    if ctx.device != "cpu":
        return (
            f"the model's tensors live in {ctx.device} memory, whose allocator is the device's own; "
            "glibc malloc is not on the training step's path"
        )
    return glibc.why_not()


def _activate(ctx: Context) -> None:
    global _tuned
    reason = _cannot_act(ctx)
    if reason is not None:
        # never an error under --strict: no call of megatron's runs differently either way
        Fallback(NAME, strict=False, instead="glibc malloc's defaults kept")(reason)
        return
    if not _tuned:
        glibc.tune()
        _tuned = True
        logging.getLogger("mindspeed_like").info(
            "%s: glibc malloc keeps freed blocks for reuse (M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB)", NAME
        )


def _switch_off() -> None:
    global _tuned
    if _tuned:
        glibc.restore()
        _tuned = False


def tuned() -> bool:
    """Whether this process's glibc malloc runs with the feature's settings now."""
    return _tuned


FEATURE = Feature(
    name=NAME,
    summary="glibc malloc keeps freed host blocks for the next step (no per-step mmap/munmap and page faults) "
    "on a CPU host; process-wide, results unchanged",
    flags=(
        Flag(
            "tune_host_allocator",
            bool,
            False,
            "on a CPU host, set glibc malloc to keep the blocks a step frees for the next step (M_MMAP_MAX=0, "
            "M_TRIM_THRESHOLD=2 GiB) instead of unmapping them; steps skip the page faults of fresh memory. "
            "Process-wide; stands aside for LD_PRELOADed allocators and MALLOC_* / GLIBC_TUNABLES settings",
        ),
    ),
    activate=_activate,
    before_switch_off=_switch_off,
    backend=lambda ctx: _cannot_act(ctx) or "glibc mallopt",
    switch_on={"tune_host_allocator": True},
    optimization_level=1,
)

__all__ = ["FEATURE", "NAME", "tuned"]
