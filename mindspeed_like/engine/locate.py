"""Where a dotted target lives: its module and attribute path, found WITHOUT importing it."""

from __future__ import annotations

import importlib.machinery
import os
import sys

from mindspeed_like.engine.patch import Patch, PatchTargetError


def split_target(target: str) -> tuple[str, list[str]]:
    """Split a dotted path into (module name, attribute path) without importing anything.

    Walks the package tree with PathFinder on the parents' search paths; a name in
    sys.modules counts as a module too (modules made at run time have no file).
    """
    parts = target.split(".")
    if len(parts) < 2 or not all(parts):
        raise PatchTargetError(f"patch target {target!r} is not a dotted path 'module.attribute'")
    module_name = ""
    search_path: list[str] | None = None
    for index, part in enumerate(parts):
        candidate = f"{module_name}.{part}" if module_name else part
        loaded = sys.modules.get(candidate)
        if loaded is not None:
            locations = getattr(loaded, "__path__", None)
        elif index == 0 or search_path is not None:
            locations = _namespace_dirs(part, search_path)
            if locations is None:
                spec = importlib.machinery.PathFinder.find_spec(candidate, search_path)
                if spec is None:
                    break
                locations = spec.submodule_search_locations
        else:
            break
        module_name = candidate
        search_path = list(locations) if locations else None
        if search_path is None:
            break  # a plain module: the remaining parts are attributes
    if not module_name:
        raise PatchTargetError(f"patch target {target!r}: no importable module {parts[0]!r}")
    attrs = parts[len(module_name.split(".")) :]
    if not attrs:
        raise PatchTargetError(f"patch target {target!r} names a module, not an attribute")
    return module_name, attrs


def _namespace_dirs(part: str, search_path: list[str] | None) -> list[str] | None:
    """The directories of a namespace package (a folder without ``__init__.py``) named ``part``
    inside ``search_path``, or None for anything else. Asked before PathFinder, whose namespace
    spec needs the parent package imported (a KeyError otherwise)."""
    if not search_path:
        return None
    dirs = [os.path.join(d, part) for d in search_path if os.path.isdir(os.path.join(d, part))]
    if not dirs or any(os.path.exists(os.path.join(d, "__init__.py")) for d in dirs):
        return None
    if any(os.path.exists(os.path.join(d, part + ".py")) for d in search_path):
        return None  # a module of that name wins over a namespace folder
    return dirs


def locate(patch: Patch) -> tuple[str, list[str]]:
    """The module and attribute path of ``patch``'s target (its declared ``module`` if given)."""
    if patch.module is None:
        return split_target(patch.target)
    prefix = patch.module + "."
    if not patch.target.startswith(prefix) or len(patch.target) == len(prefix):
        raise PatchTargetError(f"patch target {patch.target!r} does not lie inside its module {patch.module!r}")
    return patch.module, patch.target[len(prefix) :].split(".")
