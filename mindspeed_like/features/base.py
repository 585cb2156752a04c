"""What a feature is: typed flags, relations to other features, supported versions, patches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mindspeed_like.device import detect_device
from mindspeed_like.patching import Patch

if TYPE_CHECKING:
    from mindspeed_like.config import Config


@dataclass(frozen=True)
class Flag:
    """One typed flag.

    name: the attribute name (``use_flash_attn``); the primary option is ``--use-flash-attn``.
    aliases: further option strings, e.g. MindSpeed's spelling of the same switch.
    megatron_defines: Megatron-LM's own parser already has this option; when its parser
        is in use the value is read from Megatron's parsed args, not defined twice.
    """

    name: str
    type: type
    default: Any
    help: str
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    megatron_defines: bool = False

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def option_strings(self) -> tuple[str, ...]:
        return (self.option, *self.aliases)


def always_on(feature: Feature, config: Config) -> bool:
    """For fixes and adapters with no flag of their own."""
    return True


def on_device(device: str) -> Callable[[Feature, Config], bool]:
    """For device adapters: on when ``--device`` resolves to ``device``."""

    def enabled(feature: Feature, config: Config) -> bool:
        return detect_device(config["device"]) == device

    return enabled


def kernel_backend(config: Config) -> str:
    """The backend a fused kernel uses on this host: torch_npu's op on an NPU, else portable."""
    return "npu" if detect_device(config["device"]) == "npu" else "portable"


def _first_bool_flag_on(feature: Feature, config: Config) -> bool:
    for flag in feature.flags:
        if flag.type is bool:
            return bool(config[flag.name])
    return False


@dataclass(frozen=True)
class Feature:
    """One switchable capability, implemented as a set of patches.

    enabled: whether the config switches it on (default: its first bool flag).
    patches: the patches to apply: a fixed list, or a function of the config (called only
        when enabled).
    backend: which implementation this host would use (shown by the CLI).
    validate: extra checks of a config with the feature on; raise ConfigError.
    switched_by: for a feature without flags of its own, what turns it on (for the CLI).
    """

    name: str
    summary: str
    patches: Sequence[Patch] | Callable[[Config], list[Patch]]
    flags: tuple[Flag, ...] = ()
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    megatron_versions: str = ">=0.13"
    enabled: Callable[[Feature, Config], bool] = _first_bool_flag_on
    backend: Callable[[Config], str] = field(default=lambda config: "portable")
    validate: Callable[[Config], None] | None = None
    switched_by: str = "always on"

    def is_enabled(self, config: Config) -> bool:
        return self.enabled(self, config)

    def patches_for(self, config: Config) -> list[Patch]:
        return list(self.patches(config) if callable(self.patches) else self.patches)
