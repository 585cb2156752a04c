"""The process-wide state: the resolved config and the patches it calls for.

`apply()` is the only place where a config turns into patches: it checks the feature
relations and megatron-core versions once, removes the patches of features switched
off, and applies those switched on (the engine makes re-applying a no-op).
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any

from packaging.specifiers import SpecifierSet

from mindspeed_like import config as config_mod
from mindspeed_like.config import Config, ConfigError
from mindspeed_like.features import registry
from mindspeed_like.features.base import Feature
from mindspeed_like.megatron_version import SUPPORTED, TESTED_VERSIONS, describe, megatron_core_version
from mindspeed_like.patching import PatchEngine, PatchRecord

logger = logging.getLogger("mindspeed_like")

ENGINE = PatchEngine(alias_scopes=("megatron",), version_of=describe)

_lock = threading.RLock()
_code_overrides: dict[str, Any] = {}
_megatron_args: dict[str, Any] = {}
_current: Config | None = None
_warned_version = False


def flags() -> list:
    return config_mod.all_flags(registry.FEATURES)


def resolve_config(code: Mapping[str, Any] | None = None, argv: list[str] | None = None) -> Config:
    """The config the current sources give (without applying it)."""
    merged = dict(_code_overrides)
    merged.update(code or {})
    return config_mod.resolve(
        flags(),
        env=config_mod.env_text(),
        argv=sys.argv[1:] if argv is None else argv,
        megatron_args=_megatron_args,
        code=merged,
    )


def check_relations(config: Config, enabled: list[Feature]) -> None:
    names = {f.name for f in enabled}
    for feature in enabled:
        for required in feature.requires:
            if required not in names:
                raise ConfigError(
                    f"feature '{feature.name}' requires feature '{required}' (switch it on: {_how_to_enable(required)})"
                )
        for other in feature.conflicts:
            if other in names:
                raise ConfigError(f"features '{feature.name}' and '{other}' cannot be used together; switch one off")
        if feature.validate is not None:
            feature.validate(config)


def _how_to_enable(name: str) -> str:
    feature = registry.feature_by_name(name)
    bool_flags = [f.option for f in feature.flags if f.type is bool]
    return bool_flags[0] if bool_flags else "it is switched on by the device or other flags"


def check_versions(enabled: list[Feature]) -> None:
    global _warned_version
    version = megatron_core_version()
    if version is None:
        return  # nothing to patch yet; targets are checked when megatron is imported
    if version not in SUPPORTED and not _warned_version:
        _warned_version = True
        warnings.warn(
            f"mindspeed_like supports megatron-core {SUPPORTED} (tested: {', '.join(TESTED_VERSIONS)}); "
            f"{version} is installed (e.g. from a source checkout on sys.path). Every patch target is "
            "still checked when applied, but expect failures; install a supported release.",
            stacklevel=3,
        )
    for feature in enabled:
        if version not in SpecifierSet(feature.megatron_versions, prereleases=True):
            raise ConfigError(
                f"feature '{feature.name}' supports megatron-core {feature.megatron_versions}; "
                f"megatron-core {version} is installed"
            )


def apply(code: Mapping[str, Any] | None = None) -> Config:
    """Resolve the config from all sources and bring the patches in line with it."""
    global _current
    with _lock:
        config = resolve_config(code)
        enabled = [f for f in registry.FEATURES if f.is_enabled(config)]
        check_relations(config, enabled)
        check_versions(enabled)
        if code:
            _code_overrides.update(config_mod.normalize_names(flags(), code, "configure()"))
        for feature in registry.FEATURES:
            if feature not in enabled:
                ENGINE.remove(feature.name)
        for feature in enabled:
            _apply_feature(feature, config)
        _current = config
        return config


def _apply_feature(feature: Feature, config: Config) -> None:
    patches = feature.patches_for(config)
    wanted = {p.target for p in patches}
    if ENGINE.targets(feature.name) - wanted:
        ENGINE.remove(feature.name)  # the config now asks for a different set of patches
    try:
        ENGINE.apply(feature.name, patches)
    except Exception:
        ENGINE.remove(feature.name)  # all or nothing per feature
        raise


def set_megatron_args(values: Mapping[str, Any]) -> Config:
    """Values read from Megatron-LM's parsed args (the 'megatron-args' source); re-applies."""
    with _lock:
        _megatron_args.clear()
        _megatron_args.update(values)
        return apply()


def enabled_feature_names(config: Config) -> list[str]:
    return [f.name for f in registry.FEATURES if f.is_enabled(config)]


def current_config() -> Config:
    return _current if _current is not None else resolve_config()


def report() -> list[PatchRecord]:
    return ENGINE.report()


def reset() -> None:
    """Remove every patch and forget configure() and Megatron-args values (tests use this)."""
    global _current
    with _lock:
        ENGINE.remove_all()
        _code_overrides.clear()
        _megatron_args.clear()
        _current = None
