"""The one message for a change the library makes to Megatron-LM's parsed arguments.

Features and fixes that must change what a user gave on Megatron-LM's command line (a default only
megatron's CUDA kernels can honour, a flag megatron's FSDP paths need with another) say so once, on
rank 0, in the same words, so a user finds every such change by one search of the log."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("mindspeed_like")


def say_adjusted(who: str, args: Any, changes: list[str]) -> list[str]:
    """Log on rank 0 that ``who`` (a feature's name) made ``changes`` (``"args.x: a -> b (why)"``) to
    Megatron-LM's ``args``; returns ``changes``."""
    if changes and getattr(args, "rank", 0) == 0:
        logger.warning("mindspeed_like %s adjusted Megatron-LM arguments:\n  %s", who, "\n  ".join(changes))
    return changes
