"""What a feature is, and what it is handed when its patches are built.

A feature is data: typed flags, relations to other features, and a function from a
:class:`Context` (the resolved configuration, the device, the installed megatron-core version)
to its patches. Configuration flows down through the Context; nothing in a feature reads
global state when it is called later. Users add their own features with the same types
(``mindspeed_like.register_feature``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from mindspeed_like.engine import Patch
from mindspeed_like.toolkit.errors import FeatureUnsupported, LevelConflict
from mindspeed_like.toolkit.fallback import Fallback
from mindspeed_like.toolkit.precision import PRECISIONS, precision_checked
from mindspeed_like.toolkit.resolved_config import Config

if TYPE_CHECKING:
    import argparse


@dataclass(frozen=True)
class Flag:
    """One typed flag.

    name: the attribute name (``use_flash_attn``); the primary option is ``--use-flash-attn``.
    aliases: further option strings, e.g. MindSpeed's spelling of the same switch.
    megatron_defines: Megatron-LM's own parser already has this option; when its parser is in
        use the value is read from Megatron's parsed args, not defined twice.
    generic: the name is common in training scripts' own flags (``--device``, ``--strict``): on a
        script's command line only the namespaced ``--mindspeed-<name>`` is read, so the import
        line never takes a script's flag; env, configure() and Megatron-LM's parser accept both.
    """

    name: str
    type: type
    default: Any
    help: str
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    megatron_defines: bool = False
    generic: bool = False

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def namespaced_option(self) -> str:
        return "--mindspeed-" + self.name.replace("_", "-")

    @property
    def option_strings(self) -> tuple[str, ...]:
        return (self.option, *self.aliases, *((self.namespaced_option,) if self.generic else ()))

    @property
    def argv_option_strings(self) -> tuple[str, ...]:
        """The spellings read from a script's own command line (``sys.argv``)."""
        return (self.namespaced_option,) if self.generic else self.option_strings


@dataclass(frozen=True, eq=False)
class Context:
    """What a feature's callables are handed: the resolved config and facts about this host.

    config: the resolved flag values (``ctx["use_flash_attn"]`` reads one).
    device: the device megatron runs on here: ``"cpu"``, ``"cuda"`` or ``"npu"``.
    megatron_version: the megatron-core version ``import megatron.core`` would load (None: none).
    features: the features switched on (set once they are known; integrations use it).
    flags: every flag of every registered feature (for Megatron-LM's parser).
    megatron_args_sink: hands values parsed from Megatron-LM's command line to the runtime,
        which re-applies and returns the new Context (used by the Megatron-LM integration).
    resolve_conflict: hands a :class:`LevelConflict` found after configuration (a validate_args
        hook, an optimizer being built) to the runtime: a feature only ``--optimization-level``
        switched on steps aside (re-applied, logged once) and the new Context is returned;
        otherwise the conflict is raised as the error it is.
    """

    config: Config
    device: str = "cpu"
    megatron_version: Version | None = None
    features: tuple[Feature, ...] = ()
    flags: tuple[Flag, ...] = ()
    megatron_args_sink: Callable[[dict[str, Any]], Context] | None = None
    resolve_conflict: Callable[[LevelConflict], Context] | None = None

    def __getitem__(self, name: str) -> Any:
        return self.config[name]

    @property
    def strict(self) -> bool:
        return bool(self.config["strict"])

    @property
    def kernel_backend(self) -> str:
        """The backend a fused kernel uses on this host: torch_npu's op on an NPU, else portable."""
        return "npu" if self.device == "npu" else "portable"

    def megatron_at_least(self, version: str) -> bool:
        """Whether the installed megatron-core is at least ``version`` (unknown: the newest)."""
        return self.megatron_version is None or self.megatron_version >= Version(version)

    def fallback(
        self,
        feature: str,
        error: type[Exception] = FeatureUnsupported,
        instead: str = "using megatron's path",
        logger: str = "mindspeed_like",
    ) -> Fallback:
        """The feature's :class:`Fallback`: logs each reason once, raises ``error`` under --strict."""
        return Fallback(feature, self.strict, error, instead, logger)

    @property
    def enabled_names(self) -> list[str]:
        return [f.name for f in self.features]


def always_on(ctx: Context) -> bool:
    """For fixes and integrations with no flag of their own."""
    return True


def on_device(device: str) -> Callable[[Context], bool]:
    """For device adapters: on when ``--device`` resolves to ``device``."""

    def enabled(ctx: Context) -> bool:
        return ctx.device == device

    enabled.__name__ = f"on_{device}"
    return enabled


def kernel_backend(ctx: Context) -> str:
    return ctx.kernel_backend


ValidateArgsHook = Callable[["argparse.Namespace"], contextlib.AbstractContextManager]
"""Runs around Megatron-LM's ``validate_args(args)``: code before ``yield`` sees the parsed args
before validation, code after it the validated ones (raise there to refuse them)."""


@dataclass(frozen=True)
class Feature:
    """One switchable capability, implemented as a set of patches.

    patches: a fixed list, or a function of the :class:`Context` (called only when enabled).
    flags: the feature's typed flags (they appear on every command line, env and configure()).
    requires / conflicts: names of features that must / must not be on with this one.
    megatron_versions: the megatron-core versions the feature supports as a whole (None: every
        version the library supports); choosing targets per version is done by ``Patch.versions``.
    enabled: whether the context switches it on (default: its first bool flag).
    backend: which implementation this host would use (shown by the CLI): text or a function.
    validate: extra checks of a context with the feature on; raise ConfigError.
    switched_by: for a feature without a flag of its own, what turns it on (for the CLI).
    validate_args_hook: runs around Megatron-LM's validate_args while the feature is on
        (one wrap of validate_args serves every feature: see integrations/megatron_lm.py).
    activate: called each time the feature is applied, just before its patches, for a change
        that is not an attribute (e.g. importing torch_npu's transfer_to_npu). Building the
        patch list itself must stay free of side effects (the CLI and the version audit do it).
    kind: "feature" (an acceleration), "adapter" (device bring-up), "fix" (an upstream bug) or
        "integration"; shown by the CLI.
    switch_on: the flag values that switch the feature on in a typical run (what the
        all-features test and optimization levels use); empty for features the device or
        megatron's own config switch on.
    switch_off: the flag values that switch it off, where a flag's default does not (a feature
        on by default, or a non-bool switch such as ``grouped_gemm="auto"``); by default the
        defaults of the ``switch_on`` flags.
    before_switch_off: called before the feature's patches are removed (switched off by
        configure(), or reset()) when state built with them can outlive them: bring that state
        back to megatron's own form, or raise ConfigError to refuse the switch.
    optimization_level: the lowest ``--optimization-level`` that switches the feature on (1: its
        results equal megatron's bitwise or within fp32 rounding; 2: it trades numerics or time
        for memory; see ``mindspeed_like.levels``); None: no level touches it.
    built_at_construction: what a model keeps from the moment it was built when the feature is
        switched on or off later (e.g. "its RMSNorm modules"); empty for features that act at
        call time. Switching such a feature while a megatron model exists is a logged fallback
        (a ConfigError under --strict): that model keeps what it was built with.
    precisions: the training precisions the feature acts in (of ``toolkit.precision.PRECISIONS``:
        fp32, fp16, bf16); empty: every one. A run in another precision is a ``LevelConflict``
        where the precision becomes known (see ``toolkit/precision.py``): switched on by
        ``--optimization-level`` the feature steps aside saying why, asked for by name it is the
        error. The Megatron-LM check runs first in the feature's ``validate_args_hook``.
    """

    name: str
    summary: str
    patches: Sequence[Patch] | Callable[[Context], Sequence[Patch]] = ()
    flags: tuple[Flag, ...] = ()
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    megatron_versions: str | None = None
    enabled: Callable[[Context], bool] | None = None
    backend: str | Callable[[Context], str] = "portable"
    validate: Callable[[Context], None] | None = None
    switched_by: str = "always on"
    validate_args_hook: ValidateArgsHook | None = None
    activate: Callable[[Context], None] | None = None
    kind: str = "feature"
    switch_on: Mapping[str, Any] = field(default_factory=dict, compare=False)
    switch_off: Mapping[str, Any] = field(default_factory=dict, compare=False)
    optimization_level: int | None = None
    before_switch_off: Callable[[], None] | None = None
    built_at_construction: str = ""
    precisions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.strip() or " " in self.name:
            raise ValueError(f"feature name {self.name!r} must be a non-empty word (e.g. 'my-feature')")
        if self.kind not in ("feature", "adapter", "fix", "integration"):
            raise ValueError(f"feature {self.name!r}: kind {self.kind!r} is not one of feature/adapter/fix/integration")
        declared = {f.name for f in self.flags}
        for what, values in (("switch_on", self.switch_on), ("switch_off", self.switch_off)):
            unknown = set(values) - declared
            if unknown:
                raise ValueError(f"feature {self.name!r}: {what} names flags it does not declare: {sorted(unknown)}")
        if self.optimization_level is not None:
            if self.optimization_level not in (1, 2):
                raise ValueError(f"feature {self.name!r}: optimization_level must be 1 or 2 (or None)")
            if not self.switch_on:
                raise ValueError(f"feature {self.name!r}: an optimization_level needs switch_on (the values it sets)")
        unknown = set(self.precisions) - set(PRECISIONS)
        if unknown:
            raise ValueError(f"feature {self.name!r}: precisions {sorted(unknown)} are not of {PRECISIONS}")
        if self.precisions:
            object.__setattr__(self, "validate_args_hook", precision_checked(self, self.validate_args_hook))

    @property
    def off_values(self) -> dict[str, Any]:
        """The flag values that switch the feature off (``switch_off`` over the flags' defaults)."""
        defaults = {f.name: f.default for f in self.flags if f.name in self.switch_on}
        return {**defaults, **self.switch_off}

    def is_enabled(self, ctx: Context) -> bool:
        if self.enabled is not None:
            return bool(self.enabled(ctx))
        for flag in self.flags:
            if flag.type is bool:
                return bool(ctx[flag.name])
        return False

    def patches_for(self, ctx: Context) -> list[Patch]:
        return list(self.patches(ctx) if callable(self.patches) else self.patches)

    def backend_for(self, ctx: Context) -> str:
        return self.backend(ctx) if callable(self.backend) else self.backend
