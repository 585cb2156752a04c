"""Which features exist: the built-in ones, found on disk, and the ones users register.

Built-in features are the ``FEATURE`` of every module or package directly inside
``mindspeed_like.adapters``, ``.fixes``, ``.integrations`` and ``.features``: adding one is adding
its package, with no list to edit; a concern with a package of its own at the top
(``mindspeed_like.te_backend``) declares its ``FEATURE`` in that package and is listed in
:data:`BUILTIN_MODULES` (its other modules import megatron and are not scanned). Their order
means nothing: two features patching one target declare their order on the patch (see
``engine.stacking``). Users and downstream frameworks add
their own with :func:`register_feature`; they get flags, configure(), the report, reset() and
the stacking rule exactly like the built-in ones.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import threading

from mindspeed_like.toolkit.declaration import Feature
from mindspeed_like.toolkit.errors import ConfigError

BUILTIN_PACKAGES = ("adapters", "fixes", "integrations", "features")
BUILTIN_MODULES = ("te_backend", "te_shim")

_lock = threading.RLock()
_registered: dict[str, Feature] = {}


@functools.cache
def builtin_features() -> tuple[Feature, ...]:
    """Every built-in feature, adapters first, then fixes, integrations and accelerations, by name;
    then the top-level concerns (:data:`BUILTIN_MODULES`)."""
    found: list[Feature] = []
    for package_name in BUILTIN_PACKAGES:
        package = importlib.import_module(f"mindspeed_like.{package_name}")
        members = []
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            feature = getattr(module, "FEATURE", None)
            if isinstance(feature, Feature):
                members.append(feature)
        found.extend(sorted(members, key=lambda f: f.name))
    for module_name in BUILTIN_MODULES:
        found.append(importlib.import_module(f"mindspeed_like.{module_name}").FEATURE)
    names = [f.name for f in found]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise RuntimeError(f"built-in features declared twice: {sorted(duplicates)}")
    return tuple(found)


def all_features() -> list[Feature]:
    """Built-in features, then registered ones in registration order."""
    with _lock:
        return [*builtin_features(), *_registered.values()]


def feature_by_name(name: str) -> Feature:
    for feature in all_features():
        if feature.name == name:
            return feature
    raise KeyError(f"no feature named {name!r}; known: {[f.name for f in all_features()]}")


def register_feature(feature: Feature) -> Feature:
    """Add a user feature. Its name and its flags' option strings must be new. Takes effect at the
    next ``configure()`` (or the adaptor's import). Registering the same object again is a no-op."""
    from mindspeed_like.config import all_flags

    if not isinstance(feature, Feature):
        raise TypeError(f"register_feature takes a mindspeed_like.Feature, got {type(feature).__name__}")
    with _lock:
        existing = next((f for f in all_features() if f.name == feature.name), None)
        if existing is feature:
            return feature
        if existing is not None:
            raise ConfigError(f"a feature named {feature.name!r} is already registered; pick another name")
        all_flags([*all_features(), feature])  # raises on a clashing flag or option string
        _registered[feature.name] = feature
        return feature


def unregister_feature(name: str) -> None:
    """Remove a registered (not built-in) feature; call ``mindspeed_like.configure()`` or
    ``reset()`` afterwards to take its patches off."""
    with _lock:
        if name not in _registered:
            builtin = any(f.name == name for f in builtin_features())
            raise KeyError(f"{name!r} is a built-in feature" if builtin else f"no registered feature {name!r}")
        del _registered[name]
