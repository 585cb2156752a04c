"""mindspeed_like: a non-invasive acceleration library for megatron-core.

    import mindspeed_like.megatron_adaptor          # reads flags, applies the features

or from code (frameworks that build their arguments in code):

    import mindspeed_like
    mindspeed_like.configure(use_fused_rmsnorm=True)

Importing this package alone changes nothing; the adaptor or configure() applies patches.
Your own features are built like ours (``docs/plugins.md``)::

    from mindspeed_like import Feature, Flag, Kind, Patch, register_feature
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mindspeed_like.engine import Kind, Patch, PatchRecord
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.errors import ConfigError, FeatureUnsupported

__version__ = "0.1.0"

if TYPE_CHECKING:
    from mindspeed_like.config import Config


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
    """Every patch applied (or waiting for its module's import), with feature, target, kind,
    aliases and, where several features patch one target, their stacking order."""
    from mindspeed_like import runtime

    return runtime.report()


def current_config() -> Config:
    from mindspeed_like import runtime

    return runtime.current_config()


def reset() -> None:
    """Remove every patch, restoring megatron's original objects, and forget configure() values."""
    from mindspeed_like import runtime

    runtime.reset()


def register_feature(feature: Feature) -> Feature:
    """Add your own feature (``docs/plugins.md``): its flags join every command line, the env
    variable and configure(); its patches follow the same rules as ours (checked targets,
    declared versions and stacking, report, reset). Applied at the next configure()."""
    from mindspeed_like import registry

    return registry.register_feature(feature)


def unregister_feature(name: str) -> None:
    """Remove a registered feature; its patches go at the next configure() or reset()."""
    from mindspeed_like import registry

    registry.unregister_feature(name)


__all__ = [
    "ConfigError",
    "Context",
    "Feature",
    "FeatureUnsupported",
    "Flag",
    "Kind",
    "Patch",
    "PatchRecord",
    "__version__",
    "configure",
    "current_config",
    "register_feature",
    "report",
    "reset",
    "unregister_feature",
]
