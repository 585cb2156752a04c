"""The patching engine: apply, track and undo patches to third-party modules.

It knows nothing about megatron or kernels. A patch (``engine.patch.Patch``) names a dotted
target and an explicit kind; the engine

* resolves the module part WITHOUT importing it, so a target in a module that is not imported
  yet waits for that import through a wrapt post-import hook and is applied the moment the
  module finishes executing: import order does not matter;
* applies a patch only to the versions of the target's package it declares (``versions``);
* refuses to create attributes: a missing target is a ``PatchTargetError`` naming the feature,
  the target and the installed version (optional patches log a skip instead, or hand the
  reason to their ``on_missing``, a feature's fallback, when the skip changes behaviour);
* replaces every alias of a replaced module-level object held by modules inside the alias
  scopes (``from x import f`` copies the object into the importer's globals);
* stacks several features' patches of one target in their DECLARED order (``after`` /
  ``before``) and refuses an undeclared second patch of a target, naming both features;
* is idempotent (applying equal patches again is a no-op) and reversible (``remove`` restores
  every original object by identity, aliases included, also in modules imported while the
  patch was active), in any order of features.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import inspect
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import wrapt
from packaging.version import Version

from mindspeed_like.engine import stacking
from mindspeed_like.engine.locate import locate
from mindspeed_like.engine.patch import Kind, Patch, PatchError, PatchRecord, PatchTargetError, resolved

logger = logging.getLogger("mindspeed_like")

UNKNOWN_VERSION_MEANS = Version("9999")  # the newest layout (see Patch.versions)


def distribution_version(target: str) -> tuple[str, Version | None]:
    """(distribution name, installed version) of the package holding ``target``, from pip metadata.
    (importlib.metadata is imported here: it pulls in the email package, a third of a second that
    ``import mindspeed_like`` need not pay before a patch is applied.)"""
    import importlib.metadata

    top = target.split(".", 1)[0]
    try:
        dists = importlib.metadata.packages_distributions().get(top, [])
    except Exception:  # pragma: no cover - metadata scanning is best effort
        dists = []
    for dist in dists:
        try:
            return dist, Version(importlib.metadata.version(dist))
        except (importlib.metadata.PackageNotFoundError, ValueError):
            continue
    return top, None


@dataclass
class _Active:
    """Book-keeping of one applied patch: enough to undo it exactly."""

    feature: str
    patch: Patch
    owner: Any
    attr: str
    original: Any  # the raw object found in owner.__dict__ (or the inherited one)
    installed: Any  # the object we put there
    had_own_attr: bool  # False: the attribute was inherited (or unbound), undo deletes ours
    aliases: bool = False  # other modules' copies of `original` were swapped (and go back on undo)
    restores: bool = True  # False: found in place already (another patch's alias swap), undo leaves it


@dataclass(frozen=True)
class _CountingWrapper:
    """A WRAP patch's wrapper that counts its calls under its feature's name first."""

    inner: Callable
    counter: collections.Counter
    feature: str

    def __call__(self, wrapped, instance, args, kwargs):
        self.counter[self.feature] += 1
        return self.inner(wrapped, instance, args, kwargs)


def wrappers_of(function: Any) -> list[Any]:
    """The wrapper objects (a WRAP patch's ``new``) stacked on ``function``, outermost first: each
    wrapt layer's wrapper, seen through the engine's call counter (compare's arms count calls), so
    a caller can ask "is feature X's wrapper in place" without knowing whether calls are counted."""
    found = []
    while function is not None:
        wrapper = getattr(function, "_self_wrapper", None)
        if wrapper is not None:
            found.append(wrapper.inner if isinstance(wrapper, _CountingWrapper) else wrapper)
        function = getattr(function, "__wrapped__", None)
    return found


class PatchEngine:
    """Applies patches by feature and undoes them by identity.

    alias_scopes: module-name prefixes whose module globals are scanned for aliases of replaced
        objects, and the only places a patch may change without being declared ``global_change``.
    version_of: ``target -> (package name, version or None)`` for ``Patch.versions`` and messages.
    """

    def __init__(
        self,
        alias_scopes: Sequence[str],
        version_of: Callable[[str], tuple[str, Version | None]] = distribution_version,
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
        self.calls: collections.Counter | None = None
        """Calls into WRAP patches per feature, when a Counter is set here before the features
        are applied (`mindspeed-like compare` does, to tell a feature that ran from one that
        was on but never reached); None (default): nothing is counted. A feature without patches,
        made of its ``activate`` alone, is counted once each time the runtime activates it."""

    # ------------------------------------------------------------------ public API
    def applicable(self, patches: Iterable[Patch]) -> list[Patch]:
        """The patches whose declared versions include the installed version of their package."""
        result = []
        for patch in patches:
            specifier = patch.specifier()
            if specifier is None:
                result.append(patch)
                continue
            _, version = self._version_of(patch.target)
            if (version or UNKNOWN_VERSION_MEANS) in specifier:
                result.append(patch)
        return result

    def check(self, plan: Mapping[str, Iterable[Patch]]) -> None:
        """Raise if the features of ``plan`` (feature -> patches), applied together, would break a
        rule: one feature patching one target twice, or two features on one target without a
        declared order. Nothing is applied. Features not in ``plan`` are taken as they are now."""
        with self._lock:
            by_target: dict[str, list[tuple[str, Patch]]] = {}
            for feature, target in self._order:
                if feature in plan or (feature, target) in self._skipped:
                    continue
                patch = self._known_patch(feature, target)
                if patch is not None:
                    by_target.setdefault(target, []).append((feature, patch))
            for feature, patches in plan.items():
                seen: set[str] = set()
                for patch in self.applicable(patches):
                    if patch.target in seen:
                        raise PatchError(
                            f"feature '{feature}' declares two patches of '{patch.target}' for the installed "
                            f"{self._describe(patch.target)}; narrow their versions"
                        )
                    seen.add(patch.target)
                    by_target.setdefault(patch.target, []).append((feature, patch))
            for target, entries in by_target.items():
                if len(entries) > 1:
                    stacking.ordered(entries, target)

    def apply(self, feature: str, patches: Iterable[Patch]) -> None:
        """Make ``feature``'s patches exactly ``patches`` (those of the installed versions).

        Patches equal to the applied ones are left alone; the feature's other patches are
        removed. Stacking is checked first: nothing changes when it is refused.
        """
        patches = list(patches)
        with self._lock, self._batch():
            self.check({feature: patches})
            wanted = self.applicable(patches)
            targets = {p.target for p in wanted}
            for key in [k for k in self._order if k[0] == feature and k[1] not in targets]:
                self._remove_key(key)
            for patch in wanted:
                self._apply_one(feature, patch)

    def remove(self, feature: str) -> None:
        """Undo every patch of ``feature`` (applied or pending), restoring originals by identity."""
        with self._lock, self._batch():
            for key in [k for k in self._order if k[0] == feature]:
                self._remove_key(key)

    def remove_all(self) -> None:
        with self._lock:
            for feature in list(dict.fromkeys(f for f, _ in reversed(self._order))):
                self.remove(feature)

    def report(self) -> list[PatchRecord]:
        """Every patch known to the engine, in the order it was first applied."""
        records = []
        with self._lock:
            stacks = self._stacks()
            for feature, target in self._order:
                entry = self._entry(feature, target)
                if entry is not None:
                    patch, status = entry.patch, "applied"
                    aliases = tuple(f"{m}.{n}" for m, n in self._aliases_of(entry))
                elif (feature, target) in self._pending:
                    patch, status, aliases = self._pending[(feature, target)], "pending", ()
                else:
                    patch, status, aliases = self._skipped[(feature, target)], "skipped", ()
                records.append(
                    PatchRecord(
                        feature,
                        target,
                        patch.kind.value,
                        status,
                        aliases,
                        patch.why,
                        patch.global_change,
                        stacks.get(target, (feature,)),
                    )
                )
        return records

    # ------------------------------------------------------------------ internals
    def _describe(self, target: str) -> str:
        name, version = self._version_of(target)
        return f"{name} {version}" if version is not None else f"{name} (version unknown)"

    def _entry(self, feature: str, target: str) -> _Active | None:
        return next((e for e in self._active.get(target, []) if e.feature == feature), None)

    def _known_patch(self, feature: str, target: str) -> Patch | None:
        entry = self._entry(feature, target)
        if entry is not None:
            return entry.patch
        return self._pending.get((feature, target))

    def _stacks(self) -> dict[str, tuple[str, ...]]:
        """Per target with more than one feature: the features bottom to top (declared order)."""
        by_target: dict[str, list[tuple[str, Patch]]] = {}
        for feature, target in self._order:
            patch = self._known_patch(feature, target)
            if patch is not None:
                by_target.setdefault(target, []).append((feature, patch))
        return {
            target: tuple(f for f, _ in stacking.ordered(entries, target))
            for target, entries in by_target.items()
            if len(entries) > 1
        }

    def _in_scope(self, module_name: str) -> bool:
        return any(module_name == s or module_name.startswith(s + ".") for s in self.alias_scopes)

    def _error(self, feature: str, patch: Patch, detail: str) -> PatchTargetError:
        installed = self._describe(patch.target)
        package = patch.target.split(".")[0]
        if importlib.util.find_spec(package) is None:
            return PatchTargetError(
                f"feature '{feature}': patch target '{patch.target}' {detail}: {package} is not installed "
                f"in this Python ({sys.executable}). Install it (e.g. pip install megatron-core) into the "
                "environment that runs your script."
            )
        return PatchTargetError(
            f"feature '{feature}': patch target '{patch.target}' {detail} "
            f"(installed: {installed}). The installed version does not have "
            f"what this feature patches; use a supported version or switch the feature off."
        )

    def _apply_one(self, feature: str, patch: Patch) -> None:
        key = (feature, patch.target)
        current = self._entry(feature, patch.target)
        if current is not None:
            if current.patch == patch:
                return  # idempotent
            self._remove_entry(current)
        if key in self._pending:
            if self._pending[key] == patch:
                return
            del self._pending[key]
        self._skipped.pop(key, None)
        try:
            module_name, attrs = locate(patch)
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
        self._install_in_order(feature, patch, module, attrs)

    def _remove_key(self, key: tuple[str, str]) -> None:
        self._pending.pop(key, None)
        self._skipped.pop(key, None)
        entry = self._entry(*key)
        if entry is not None:
            self._remove_entry(entry)
        if key in self._order:
            self._order.remove(key)

    def _skip(self, feature: str, patch: Patch, why: str) -> None:
        key = (feature, patch.target)
        self._skipped[key] = patch
        self._pending.pop(key, None)
        if key not in self._order:
            self._order.append(key)
        if patch.on_missing is not None:
            patch.on_missing(f"patch target '{patch.target}' {why} (installed: {self._describe(patch.target)})")
            return
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
                module_name, attrs = locate(patch)
                if module_name != module.__name__:
                    continue
                del self._pending[(feature, target)]
                try:
                    self._install_in_order(feature, patch, module, attrs)
                except BaseException:
                    # the importer sees the error; the book-keeping must not keep a patch that is
                    # neither applied nor pending (report() and remove() walk _order)
                    self._order = [k for k in self._order if k != (feature, target)]
                    raise

    def _install_in_order(self, feature: str, patch: Patch, module: types.ModuleType, attrs: list[str]) -> None:
        """Install ``patch`` at its declared place in the target's stack: the entries that must
        sit above it are peeled off, and put back on top of it."""
        stack = self._active.get(patch.target, [])
        above = [e for e in stack if stacking.relation((e.feature, e.patch), (feature, patch), patch.target)]
        if not above:
            self._install(feature, patch, module, attrs)
            return
        position = stack.index(above[0])
        peeled = stack[position:]
        for upper in reversed(peeled):
            self._undo(upper)
        del stack[position:]
        self._install(feature, patch, module, attrs)
        for upper in peeled:
            upper_module, upper_attrs = locate(upper.patch)
            self._install(upper.feature, upper.patch, sys.modules[upper_module], upper_attrs)

    def _install(self, feature: str, patch: Patch, module: types.ModuleType, attrs: list[str]) -> None:
        owner: Any = module
        for name in attrs[:-1]:
            if not hasattr(owner, name):
                return self._missing(feature, patch, f"has no '{name}' in {module.__name__}")
            owner = getattr(owner, name)
        attr = attrs[-1]
        if patch.kind is Kind.PROVIDE:
            return self._provide(feature, patch, owner, attr)
        had_own = attr in vars(owner) if isinstance(owner, (type, types.ModuleType)) else False
        if not had_own:
            if not isinstance(owner, type) or not hasattr(owner, attr):
                return self._missing(feature, patch, "does not exist")
            original = inspect.getattr_static(owner, attr)
        else:
            original = vars(owner)[attr]
        if patch.kind is Kind.WRAP and not callable(original) and not isinstance(original, (staticmethod, classmethod)):
            raise self._error(feature, patch, "is not callable (WRAP needs a callable)")
        if patch.kind is Kind.REPLACE and patch.update_aliases and isinstance(owner, types.ModuleType):
            if original is None or isinstance(original, (bool, int, float, str, bytes)):
                # identity means nothing for such values: every module's False is the same object
                self._order = [k for k in self._order if k != (feature, patch.target)]
                raise PatchError(
                    f"feature '{feature}': patch target '{patch.target}' holds the plain value {original!r}, whose "
                    "copies in other modules cannot be told apart by identity; declare update_aliases=False"
                )
        counted = self.calls is not None and patch.counts_as_reached
        wrapper = _CountingWrapper(patch.new, self.calls, feature) if counted else patch.new
        installed = wrapt.FunctionWrapper(original, wrapper) if patch.kind is Kind.WRAP else resolved(patch.new)
        setattr(owner, attr, installed)
        aliases = isinstance(owner, types.ModuleType) and patch.update_aliases
        entry = _Active(feature, patch, owner, attr, original, installed, had_own, aliases)
        if aliases:
            self._swap_aliases(original, installed, skip=(owner.__name__, attr))
        self._active.setdefault(patch.target, []).append(entry)
        logger.debug("feature '%s': %s %s", feature, patch.kind.value, patch.target)
        return None

    def _provide(self, feature: str, patch: Patch, owner: Any, attr: str) -> None:
        if not isinstance(owner, types.ModuleType):
            raise PatchError(f"feature '{feature}': PROVIDE target '{patch.target}' must be a module-level name")
        namespace = vars(owner)
        bound = attr in namespace
        current = namespace.get(attr)
        installed = resolved(patch.new)
        placeholder = current is not None and patch.placeholder is not None and patch.placeholder(current)
        if current is not None and current is not installed and not placeholder:
            return self._missing(
                feature, patch, f"is already bound (to {current!r}): nothing to provide, its module has it"
            )
        setattr(owner, attr, installed)
        # aliases: the report's live view lists every module holding ours, whichever order put it
        # there (a placeholder swapped here, or ours found in place after another PROVIDE's swap);
        # undo swaps back only where this patch swapped (restores)
        found_ours = current is installed
        entry = _Active(
            feature, patch, owner, attr, current, installed, bound, placeholder or found_ours, not found_ours
        )
        if placeholder:
            self._swap_aliases(current, installed, skip=(owner.__name__, attr))
        self._active.setdefault(patch.target, []).append(entry)
        logger.debug("feature '%s': provide %s", feature, patch.target)
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
        if not entry.aliases:
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
        """Every scoped module global holding ``old`` gets ``new`` (except ``skip``, the owner's slot).

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
            module_name, attrs = locate(upper.patch)
            self._install(upper.feature, upper.patch, sys.modules[module_name], attrs)

    def _undo(self, entry: _Active) -> None:
        if not entry.restores:
            return  # the patch whose alias swap put it there takes it back
        if entry.had_own_attr:
            setattr(entry.owner, entry.attr, entry.original)
        else:
            delattr(entry.owner, entry.attr)
        if entry.aliases:
            # Every scoped reference to ours goes back: the aliases swapped at apply time and
            # the copies taken by modules imported while the patch was active.
            self._swap_aliases(entry.installed, entry.original)
