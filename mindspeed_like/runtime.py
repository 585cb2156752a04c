"""The process-wide state: the resolved config and the patches it calls for.

``apply()`` is the only place where a configuration turns into patches: it resolves the flags,
builds the :class:`Context` handed to every feature (config, device, megatron-core version),
checks the feature relations, versions and stacking once, removes the patches of features
switched off and applies those switched on (re-applying equal patches is a no-op). Nothing
below this module reads it back: features get what they need through the Context.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any

from mindspeed_like import config as config_mod
from mindspeed_like import levels, registry
from mindspeed_like.adapters.detect import detect_device
from mindspeed_like.config import Config
from mindspeed_like.engine import PatchEngine, PatchError, PatchRecord
from mindspeed_like.megatron_version import SUPPORTED, TESTED_VERSIONS, megatron_core_version, release_in, version_of
from mindspeed_like.toolkit import built_models
from mindspeed_like.toolkit.declaration import Context, Flag
from mindspeed_like.toolkit.errors import ConfigError, LevelConflict
from mindspeed_like.toolkit.fallback import forget_logged

logger = logging.getLogger("mindspeed_like")

ENGINE = PatchEngine(alias_scopes=("megatron",), version_of=version_of)

_lock = threading.RLock()
_code_overrides: dict[str, Any] = {}
_megatron_args: dict[str, Any] = {}
_current: Context | None = None
_warned_version = False
_stepped_aside: dict[str, str] = {}  # level member -> the explicit flag it yielded to (see levels.py)
_activated: set[str] = set()  # features whose activate() ran and that have not been switched off since


def flags() -> list[Flag]:
    return config_mod.all_flags(registry.all_features())


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
        level_values=_level_values,
    )


def _level_values(level: int) -> dict[str, Any]:
    return levels.flag_values(level, registry.all_features(), stepped_aside=_stepped_aside)


def context_for(config: Config) -> Context:
    """The Context features are built from: ``config`` plus this host's facts, and the features
    it switches on."""
    base = Context(
        config=config,
        device=detect_device(config["device"]),
        megatron_version=megatron_core_version(),
        flags=tuple(flags()),
        megatron_args_sink=set_megatron_args,
        resolve_conflict=resolve_conflict,
    )
    enabled = tuple(f for f in registry.all_features() if f.is_enabled(base))
    return dataclasses.replace(base, features=enabled)


def check_relations(ctx: Context) -> None:
    """Requirements, conflicts and each feature's own checks. A conflict between a feature the
    level switched on and one asked for by name is a :class:`LevelConflict` (``apply`` makes the
    level's feature step aside); between two features asked for by name, a ConfigError."""
    names = set(ctx.enabled_names)
    for feature in ctx.features:
        for required in feature.requires:
            if required not in names:
                raise ConfigError(
                    f"feature '{feature.name}' requires feature '{required}' (switch it on: {_how_to_enable(required)})"
                )
        for other in feature.conflicts:
            if other in names:
                _conflict(ctx, feature, registry.feature_by_name(other))
        if feature.validate is not None:
            feature.validate(ctx)


def _conflict(ctx: Context, feature, other) -> None:
    message = f"features '{feature.name}' and '{other.name}' cannot be used together; switch one off"
    by_level = {f.name: levels.set_by_level(f, ctx.config.sources) for f in (feature, other)}
    if by_level[feature.name] and not by_level[other.name]:
        raise LevelConflict(feature.name, _given(ctx, other), message)
    if by_level[other.name] and not by_level[feature.name]:
        raise LevelConflict(other.name, _given(ctx, feature), message)
    raise ConfigError(message)


def _given(ctx: Context, feature) -> str:
    """How the user switched ``feature`` on: its flags given by name, else the feature's name."""
    implicit = ("default", "optimization-level")
    given = [f.option for f in feature.flags if ctx.config.sources.get(f.name, "default") not in implicit]
    return " ".join(given) or f"feature '{feature.name}'"


def _checked_context(code: Mapping[str, Any] | None) -> Context:
    """The Context of the current sources, its relations checked; members of the level that
    conflict with an explicit flag step aside first (each re-resolves the config)."""
    for _ in range(len(registry.all_features()) + 1):
        ctx = context_for(resolve_config(code))
        try:
            check_relations(ctx)
            return ctx
        except LevelConflict as conflict:
            _step_aside(ctx, conflict)
    raise ConfigError("mindspeed_like: level members kept conflicting after stepping aside")  # pragma: no cover


def _step_aside(ctx: Context, conflict: LevelConflict) -> None:
    """The level's member yields to the explicit flag (one log line), or ``conflict`` is the error:
    the user asked for that feature by name."""
    try:
        feature = registry.feature_by_name(conflict.feature)
    except KeyError:
        raise conflict from None
    if not levels.set_by_level(feature, ctx.config.sources) or feature.name in _stepped_aside:
        raise conflict
    _stepped_aside[feature.name] = conflict.given
    if _process_rank() != 0:  # every rank steps aside; the log line is said once per job, as Megatron's
        return
    logger.warning(
        "%s (from --optimization-level %s) stepped aside: %s",
        feature.name,
        ctx.config["optimization_level"],
        conflict.reason,
    )


def _process_rank() -> int:
    """This process's global rank: torch.distributed's once initialized, else the launcher's RANK
    (Megatron-LM validates its arguments before it initializes torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def resolve_conflict(conflict: LevelConflict) -> Context:
    """A conflict found after configuration (``Context.resolve_conflict``): the level's member steps
    aside and the config is re-applied, returning the new Context; else ``conflict`` is raised.

    A conflict of a feature that is off already (it stepped aside before, or was switched off
    since) is moot: it comes from a check a client's reference kept from before (``from
    megatron.training.arguments import validate_args`` in a module outside megatron holds the
    wrapper with the hooks of that moment, and megatron's unit tests validate several times a
    process, issue 48). The member stays aside, the line is not said again, and the caller goes on
    with the current Context (whose checks do not include that feature's)."""
    with _lock:
        ctx = current_context()
        if conflict.feature not in ctx.enabled_names and _is_registered(conflict.feature):
            return ctx
        _step_aside(ctx, conflict)
        apply()
        return current_context()


def _is_registered(name: str) -> bool:
    try:
        registry.feature_by_name(name)
    except KeyError:
        return False
    return True


def _how_to_enable(name: str) -> str:
    feature = registry.feature_by_name(name)
    bool_flags = [f.option for f in feature.flags if f.type is bool]
    return bool_flags[0] if bool_flags else "it is switched on by the device or other flags"


def check_versions(ctx: Context) -> None:
    global _warned_version
    version = ctx.megatron_version
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
    for feature in ctx.features:
        if feature.megatron_versions and not release_in(feature.megatron_versions, version):
            raise ConfigError(
                f"feature '{feature.name}' supports megatron-core {feature.megatron_versions}; "
                f"megatron-core {version} is installed"
            )


def _configure_kernels(portable_kernels: str) -> None:
    from mindspeed_like.kernels import compiled

    compiled.configure_mode(portable_kernels)


def apply(code: Mapping[str, Any] | None = None) -> Config:
    """Resolve the config from all sources and bring the patches in line with it."""
    global _current
    with _lock:
        ctx = _checked_context(code)
        config = ctx.config
        _configure_kernels(config["portable_kernels"])
        check_versions(ctx)
        plan: dict[str, list] = {f.name: [] for f in registry.all_features()}
        for feature in ctx.features:
            plan[feature.name] = feature.patches_for(ctx)
        for name in {record.feature for record in ENGINE.report()} - set(plan):
            plan[name] = []  # a feature unregistered since it was applied
        try:
            ENGINE.check(plan)  # stacking and duplicates, before anything changes
        except PatchError as error:
            raise ConfigError(f"{error}") from error
        applied = {record.feature for record in ENGINE.report()}
        _report_switch_after_construction(ctx, applied)
        enabled_now = set(ctx.enabled_names)
        _before_switch_off(
            [
                name
                for name, patches in plan.items()
                if (not patches and name in applied) or (name in _activated and name not in enabled_now)
            ]
        )
        if code:
            _code_overrides.update(config_mod.normalize_names(flags(), code, "configure()"))
        for name, patches in plan.items():
            if not patches:
                ENGINE.remove(name)
        for feature in ctx.features:
            try:
                if feature.activate is not None:
                    feature.activate(ctx)
                    _activated.add(feature.name)
                    if not plan[feature.name] and ENGINE.calls is not None:
                        # a feature made of its activate() alone acts here, not in a call megatron makes
                        ENGINE.calls[feature.name] += 1
                ENGINE.apply(feature.name, plan[feature.name])
            except Exception:
                ENGINE.remove(feature.name)  # all or nothing per feature
                raise
        _current = ctx
        return config


def _report_switch_after_construction(ctx: Context, applied: set[str]) -> None:
    """A construction-time feature switched while megatron models exist changes nothing for
    them: logged once (a ConfigError under --strict, raised before anything changes)."""
    now_on = set(ctx.enabled_names)
    switched = [
        feature
        for feature in registry.all_features()
        if feature.built_at_construction and (feature.name in now_on) != (feature.name in applied)
    ]
    if not switched:
        return
    models = built_models.live_count()
    if not models:
        return
    for feature in switched:
        state = "on" if feature.name in now_on else "off"
        reason = (
            f"switched {state} while {models} megatron model(s) exist: those keep "
            f"{feature.built_at_construction} as they were built; build the model after configure() "
            "for the switch to apply to it"
        )
        if ctx.strict:
            raise ConfigError(f"{feature.name} {reason} (strict is on: nothing was changed)")
        ctx.fallback(feature.name, ConfigError, f"switched {state} for models built from now on")(reason)


def _before_switch_off(names: list[str]) -> None:
    """Each feature about to lose its patches (or, for one without patches, whose ``activate``
    ran and that is now off) brings the state built with them back to megatron's form, or
    refuses (ConfigError) before anything changes."""
    for name in names:
        try:
            feature = registry.feature_by_name(name)
        except KeyError:
            _activated.discard(name)
            continue
        if feature.before_switch_off is not None:
            feature.before_switch_off()  # may refuse (ConfigError): the feature then stays activated
        _activated.discard(name)


def set_megatron_args(values: Mapping[str, Any]) -> Context:
    """Values read from Megatron-LM's parsed args (the 'megatron-args' source); re-applies. All or
    nothing: if the new values are refused (a bad value, a conflict), the previous ones are back
    and nothing changed, so the next apply() does not fail again on values already refused."""
    with _lock:
        previous = dict(_megatron_args)
        _megatron_args.clear()
        _megatron_args.update(values)
        try:
            apply()
        except BaseException:
            _megatron_args.clear()
            _megatron_args.update(previous)
            raise
        return current_context()


def megatron_args() -> dict[str, Any]:
    """The 'megatron-args' source as it stands (flag name -> value; a copy)."""
    return dict(_megatron_args)


def enabled_feature_names(config: Config) -> list[str]:
    return context_for(config).enabled_names


def current_context() -> Context:
    return _current if _current is not None else context_for(resolve_config())


def current_config() -> Config:
    return current_context().config


def report() -> list[PatchRecord]:
    return ENGINE.report()


def activated() -> list[str]:
    """The features whose ``activate`` ran and that are still on (a feature made of its
    ``activate`` alone has no patch record in :func:`report`)."""
    return sorted(_activated)


def reset() -> None:
    """Remove every patch, forget configure() and Megatron-args values and the fallback lines
    already logged: the state of a fresh import."""
    global _current
    with _lock:
        _before_switch_off(sorted({record.feature for record in ENGINE.report()} | _activated))
        ENGINE.remove_all()
        built_models.forget()
        _code_overrides.clear()
        _megatron_args.clear()
        _stepped_aside.clear()
        forget_logged()
        _configure_kernels("auto")
        _current = None
