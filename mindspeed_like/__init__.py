"""mindspeed_like: a non-invasive acceleration library for megatron-core.

    import mindspeed_like.megatron_adaptor          # reads flags, applies the features

or from code (frameworks that build their arguments in code):

    import mindspeed_like
    mindspeed_like.configure(use_fused_rmsnorm=True)

Importing this package alone changes nothing; the adaptor or configure() applies patches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from mindspeed_like.config import Config
    from mindspeed_like.patching import PatchRecord


def configure(**flags: Any) -> Config:
    """Set flags from code (highest priority) and (re-)apply the patches they call for.

    Names are flag names with underscores (``use_flash_attn``) or MindSpeed's spellings;
    values must have the flag's type. Features switched off have their patches removed.
    Returns the resolved config. Raises ``ConfigError`` for unknown names, bad values,
    missing requirements and conflicts.
    """
    from mindspeed_like import runtime

    return runtime.apply(flags)


def report() -> list[PatchRecord]:
    """Every patch applied (or waiting for its module's import), with feature, target, kind, aliases."""
    from mindspeed_like import runtime

    return runtime.report()


def current_config() -> Config:
    from mindspeed_like import runtime

    return runtime.current_config()


def reset() -> None:
    """Remove every patch, restoring megatron's original objects, and forget configure() values."""
    from mindspeed_like import runtime

    runtime.reset()


__all__ = ["configure", "report", "current_config", "reset", "__version__"]
