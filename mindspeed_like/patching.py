"""The patching engine: apply, track and undo patches to third-party modules.

It knows nothing about megatron or kernels. A patch names a dotted target path
(``package.module.Class.attr``) and an explicit kind; the engine

* resolves the module part WITHOUT importing it (so a target in a module that is
  not imported yet waits for that import through a wrapt post-import hook and is
  applied the moment the module finishes executing: import order does not matter);
* refuses to create attributes: a missing target is a ``PatchTargetError`` that
  names the feature, the target and the installed version (optional patches log a
  skip instead);
* replaces every alias of a replaced module-level object held by modules inside
  the alias scopes (``from x import f`` copies the object into the importer's
  globals, so replacing ``x.f`` alone changes nothing for the importer);
* is idempotent (applying the same patch again is a no-op) and reversible
  (``remove`` restores every original object by identity, aliases included, also
  in modules imported while the patch was active);
* stacks patches of several features on one target and removes any of them in
  any order (the ones above are peeled off and re-applied).
"""

from __future__ import annotations

import contextlib
import enum
import importlib.machinery
import importlib.metadata
import inspect
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import wrapt

logger = logging.getLogger("mindspeed_like")


class Kind(enum.Enum):
    """How a patch changes its target. Always stated, never inferred from a name."""

    REPLACE = "replace"  # the attribute becomes `new`
    WRAP = "wrap"  # the callable is wrapped: new(wrapped, instance, args, kwargs) (wrapt)
    SET_METHOD = "set_method"  # a class's (possibly inherited) method becomes the function `new`


class PatchError(RuntimeError):
    """Base class of the engine's errors."""


class PatchTargetError(PatchError, AttributeError):
    """The target of a patch does not exist (or is of the wrong sort) in the installed package."""


@dataclass(frozen=True)
class Patch:
    """One change to one target.

    target: dotted path, module part then attribute part, e.g.
        ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add``.
    kind: see :class:`Kind`.
    new: the replacement object (REPLACE), the wrapt wrapper function (WRAP) or the
        function to install as a method (SET_METHOD).
    optional: a missing target is a logged skip instead of an error.
    why: one line for the patch report.
    global_change: the target lies outside the engine's alias scopes (e.g. a torch
        function); such changes must be declared, and the report lists them.
    module: the module part of `target`, when it must not be looked up on disk now
        (a module that may only become importable later, e.g. once a Megatron-LM
        checkout is put on sys.path). The patch then waits for that module's import.
    update_aliases: replace the other modules' copies of a module-level object too
        (default). False for a name that is deliberately module-local, e.g. giving one
        module its own view of ``torch`` without touching every module that imports torch.
    """

    target: str
    kind: Kind
    new: Any
    optional: bool = False
    why: str = ""
    global_change: bool = False
    module: str | None = None
    update_aliases: bool = True


@dataclass
class PatchRecord:
    """What the report says about one patch."""

    feature: str
    target: str
    kind: str
    status: str  # "applied" | "pending" (module not imported yet) | "skipped" (optional, missing)
    aliases: tuple[str, ...] = ()
    why: str = ""
    global_change: bool = False


@dataclass
class _Active:
    """Book-keeping of one applied patch: enough to undo it exactly."""

    feature: str
    patch: Patch
    owner: Any
    attr: str
    original: Any  # the raw object found in owner.__dict__ (or the inherited one)
    installed: Any  # the object we put there
    had_own_attr: bool  # False: the attribute was inherited, undo deletes ours


def _distribution_version(target: str) -> str:
    top = target.split(".", 1)[0]
    try:
        dists = importlib.metadata.packages_distributions().get(top, [])
    except Exception:  # pragma: no cover - metadata scanning is best effort
        dists = []
    for dist in dists:
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"{top} (version unknown)"


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


def _locate(patch: Patch) -> tuple[str, list[str]]:
    if patch.module is None:
        return split_target(patch.target)
    prefix = patch.module + "."
    if not patch.target.startswith(prefix) or len(patch.target) == len(prefix):
        raise PatchTargetError(f"patch target {patch.target!r} does not lie inside its module {patch.module!r}")
    return patch.module, patch.target[len(prefix) :].split(".")


class PatchEngine:
    """Applies patches by feature and undoes them by identity.

    alias_scopes: module-name prefixes whose module globals are scanned for aliases
    of replaced objects, and the only places a patch may change without being
    declared ``global_change``.
    """

    def __init__(
        self,
        alias_scopes: Sequence[str],
        version_of: Callable[[str], str] = _distribution_version,
    ) -> None:
        self.alias_scopes = tuple(alias_scopes)
        self._version_of = version_of
        self._lock = threading.RLock()
        self._active: dict[str, list[_Active]] = {}  # target -> stack, bottom first
        self._pending: dict[tuple[str, str], Patch] = {}  # (feature, target) -> patch
        self._skipped: dict[tuple[str, str], Patch] = {}
        self._order: list[tuple[str, str]] = []  # report order
        self._hooked_modules: set[str] = set()
        self._queued_swaps: list[tuple[Any, Any, tuple[str, str] | None]] = []
        self._batch_depth = 0
        self._scoped_cache: tuple[Any, list[types.ModuleType]] = (None, [])

    # ------------------------------------------------------------------ public API
    def apply(self, feature: str, patches: Iterable[Patch]) -> None:
        """Apply `feature`'s patches; already-applied identical ones are left alone."""
        with self._lock, self._batch():
            for patch in patches:
                self._apply_one(feature, patch)

    def remove(self, feature: str) -> None:
        """Undo every patch of `feature` (applied or pending), restoring originals by identity."""
        with self._lock, self._batch():
            for key in [k for k in self._pending if k[0] == feature]:
                del self._pending[key]
            for key in [k for k in self._skipped if k[0] == feature]:
                del self._skipped[key]
            for target in list(self._active):
                for entry in [e for e in self._active.get(target, []) if e.feature == feature]:
                    self._remove_entry(entry)
            self._order = [k for k in self._order if k[0] != feature]

    def remove_all(self) -> None:
        with self._lock:
            for feature in list(dict.fromkeys(f for f, _ in reversed(self._order))):
                self.remove(feature)

    def features(self) -> list[str]:
        """Features with at least one patch applied, pending or skipped."""
        return list(dict.fromkeys(f for f, _ in self._order))

    def targets(self, feature: str) -> set[str]:
        """Targets of `feature`'s patches known to the engine (applied, pending or skipped)."""
        return {target for f, target in self._order if f == feature}

    def is_applied(self, feature: str, target: str) -> bool:
        return any(e.feature == feature for e in self._active.get(target, []))

    def report(self) -> list[PatchRecord]:
        """Every patch known to the engine, in the order it was first applied."""
        records = []
        with self._lock:
            for feature, target in self._order:
                entry = next((e for e in self._active.get(target, []) if e.feature == feature), None)
                if entry is not None:
                    p = entry.patch
                    aliases = tuple(f"{m}.{n}" for m, n in self._aliases_of(entry))
                    records.append(
                        PatchRecord(feature, target, p.kind.value, "applied", aliases, p.why, p.global_change)
                    )
                elif (feature, target) in self._pending:
                    p = self._pending[(feature, target)]
                    records.append(PatchRecord(feature, target, p.kind.value, "pending", (), p.why, p.global_change))
                elif (feature, target) in self._skipped:
                    p = self._skipped[(feature, target)]
                    records.append(PatchRecord(feature, target, p.kind.value, "skipped", (), p.why, p.global_change))
        return records

    # ------------------------------------------------------------------ internals
    def _in_scope(self, module_name: str) -> bool:
        return any(module_name == s or module_name.startswith(s + ".") for s in self.alias_scopes)

    def _error(self, feature: str, patch: Patch, detail: str) -> PatchTargetError:
        return PatchTargetError(
            f"feature '{feature}': patch target '{patch.target}' {detail} "
            f"(installed: {self._version_of(patch.target)}). The installed version does not have "
            f"what this feature patches; use a supported version or switch the feature off."
        )

    def _apply_one(self, feature: str, patch: Patch) -> None:
        key = (feature, patch.target)
        current = next((e for e in self._active.get(patch.target, []) if e.feature == feature), None)
        if current is not None:
            if current.patch == patch:
                return  # idempotent
            self._remove_entry(current)
        if key in self._pending and self._pending[key] == patch:
            return
        self._skipped.pop(key, None)
        try:
            module_name, attrs = _locate(patch)
        except PatchTargetError as exc:
            if patch.optional:
                self._skip(feature, patch, str(exc))
                return
            raise self._error(feature, patch, "cannot be located") from exc
        if not self._in_scope(module_name) and not patch.global_change:
            raise PatchError(
                f"feature '{feature}': patch target '{patch.target}' lies outside {self.alias_scopes}; "
                f"a change there must be declared global_change=True so the report lists it"
            )
        if key not in self._order:
            self._order.append(key)
        module = sys.modules.get(module_name)
        if module is None:
            self._pending[key] = patch
            self._hook(module_name)
            return
        self._install(feature, patch, module, attrs)

    def _skip(self, feature: str, patch: Patch, why: str) -> None:
        key = (feature, patch.target)
        self._skipped[key] = patch
        self._pending.pop(key, None)
        if key not in self._order:
            self._order.append(key)
        logger.info("feature '%s': optional patch target '%s' skipped: %s", feature, patch.target, why)

    def _hook(self, module_name: str) -> None:
        if module_name in self._hooked_modules:
            return
        self._hooked_modules.add(module_name)
        wrapt.register_post_import_hook(self._on_import, module_name)

    def _on_import(self, module: types.ModuleType) -> None:
        with self._lock, self._batch():
            self._hooked_modules.discard(module.__name__)  # wrapt fires a hook once, then drops it
            for (feature, target), patch in list(self._pending.items()):
                module_name, attrs = _locate(patch)
                if module_name != module.__name__:
                    continue
                del self._pending[(feature, target)]
                self._install(feature, patch, module, attrs)

    def _install(self, feature: str, patch: Patch, module: types.ModuleType, attrs: list[str]) -> None:
        owner: Any = module
        for name in attrs[:-1]:
            if not hasattr(owner, name):
                return self._missing(feature, patch, f"has no '{name}' in {module.__name__}")
            owner = getattr(owner, name)
        attr = attrs[-1]
        had_own = attr in vars(owner) if isinstance(owner, (type, types.ModuleType)) else False
        if not had_own:
            if not isinstance(owner, type) or not hasattr(owner, attr):
                return self._missing(feature, patch, "does not exist")
            original = inspect.getattr_static(owner, attr)
        else:
            original = vars(owner)[attr]
        if patch.kind is Kind.SET_METHOD and not isinstance(owner, type):
            raise self._error(feature, patch, "is not an attribute of a class (SET_METHOD needs a class)")
        if patch.kind is Kind.WRAP and not callable(original) and not isinstance(original, (staticmethod, classmethod)):
            raise self._error(feature, patch, "is not callable (WRAP needs a callable)")
        if patch.kind is Kind.WRAP:
            installed = wrapt.FunctionWrapper(original, patch.new)
        else:
            installed = patch.new
        setattr(owner, attr, installed)
        entry = _Active(feature, patch, owner, attr, original, installed, had_own)
        if isinstance(owner, types.ModuleType) and patch.update_aliases:
            self._swap_aliases(original, installed, skip=(owner.__name__, attr))
        self._active.setdefault(patch.target, []).append(entry)
        logger.debug("feature '%s': %s %s", feature, patch.kind.value, patch.target)
        return None

    def _missing(self, feature: str, patch: Patch, detail: str) -> None:
        if patch.optional:
            self._skip(feature, patch, detail)
            return
        self._order = [k for k in self._order if k != (feature, patch.target)]
        raise self._error(feature, patch, detail)

    def _aliases_of(self, entry: _Active) -> list[tuple[str, str]]:
        """Live view: every scoped module global holding our object, whenever it got it
        (swapped at apply time, or copied by a module imported afterwards)."""
        if not isinstance(entry.owner, types.ModuleType) or not entry.patch.update_aliases:
            return []
        home = (entry.owner.__name__, entry.attr)
        return sorted(
            (module.__name__, name)
            for module in self._scoped_modules()
            for name, value in list(vars(module).items())
            if value is entry.installed and (module.__name__, name) != home
        )

    def _scoped_modules(self) -> list[types.ModuleType]:
        # Cached while sys.modules is unchanged: same size and same newest entry (imports
        # append; a module dropped and imported again becomes the newest entry).
        newest = next(reversed(sys.modules), None)
        key = (len(sys.modules), newest, id(sys.modules.get(newest)))
        if self._scoped_cache[0] != key:
            prefixes = tuple(s + "." for s in self.alias_scopes)
            modules = [
                m
                for n, m in list(sys.modules.items())
                if m is not None and (n.startswith(prefixes) or n in self.alias_scopes)
            ]
            self._scoped_cache = (key, modules)
        return self._scoped_cache[1]

    def _swap_aliases(self, old: Any, new: Any, skip: tuple[str, str] | None = None) -> None:
        """Every scoped module global holding `old` gets `new` (except `skip`, the owner's slot).

        Inside a batch the swaps are queued and done in one scan of the modules at the end
        (an import of megatron.core fires dozens of patches; one scan each cost seconds).
        """
        self._queued_swaps.append((old, new, skip))
        if self._batch_depth == 0:
            self._flush_swaps()

    @contextlib.contextmanager
    def _batch(self) -> Iterator[None]:
        self._batch_depth += 1
        try:
            yield
        finally:
            self._batch_depth -= 1
            if self._batch_depth == 0:
                self._flush_swaps()

    def _flush_swaps(self) -> None:
        swaps, self._queued_swaps = self._queued_swaps, []
        if not swaps:
            return
        olds = {id(old) for old, _, _ in swaps}
        for module in self._scoped_modules():
            namespace = vars(module)
            for name, value in list(namespace.items()):
                if id(value) not in olds:
                    continue
                current = value
                for old, new, skip in swaps:  # in order: a later swap may move a value on again
                    if current is old and (module.__name__, name) != skip:
                        current = new
                if current is not value:
                    namespace[name] = current

    def _remove_entry(self, entry: _Active) -> None:
        stack = self._active[entry.patch.target]
        position = stack.index(entry)
        above = stack[position + 1 :]
        for upper in reversed(above):  # peel off what was stacked on top
            self._undo(upper)
        self._undo(entry)
        del stack[position:]
        if not stack:
            del self._active[entry.patch.target]
        for upper in above:  # and put it back on the restored original
            module_name, attrs = _locate(upper.patch)
            self._install(upper.feature, upper.patch, sys.modules[module_name], attrs)

    def _undo(self, entry: _Active) -> None:
        if entry.had_own_attr:
            setattr(entry.owner, entry.attr, entry.original)
        else:
            delattr(entry.owner, entry.attr)
        if isinstance(entry.owner, types.ModuleType) and entry.patch.update_aliases:
            # Every scoped reference to ours goes back: the aliases swapped at apply
            # time and the copies taken by modules imported while the patch was active.
            self._swap_aliases(entry.installed, entry.original)
