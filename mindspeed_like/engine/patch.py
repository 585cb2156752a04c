"""What a patch is: one declared change to one target, and what the report says about it."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet


class Kind(enum.Enum):
    """How a patch changes its target. Always stated, never inferred from a name.

    REPLACE: the attribute becomes ``new`` (a module global, a class attribute or method,
        inherited or own: an inherited one is shadowed on the class and deleted on undo).
    WRAP: the callable is wrapped with wrapt: ``new(wrapped, instance, args, kwargs)``.
    PROVIDE: a module-level name that the module binds only when an optional dependency imports
        (its ``try: import X`` failed, so the name is unbound, bound to None, or bound to a
        stand-in object that ``Patch.placeholder`` recognises) is bound to ``new``. A name bound
        to anything else is not ours to provide: an error naming what is there (a skip for an
        optional patch); bound to ``new`` already (an alias swap got there first), nothing to do.
        Undo restores what was there. Aliases are swapped only for a placeholder object (None or
        an unbound name has no identity to follow).
    """

    REPLACE = "replace"
    WRAP = "wrap"
    PROVIDE = "provide"


class PatchError(RuntimeError):
    """Base class of the engine's errors."""


class PatchTargetError(PatchError, AttributeError):
    """The target of a patch does not exist (or is of the wrong sort) in the installed package."""


class StackingError(PatchError):
    """Two features patch one target and their order is not declared (or contradicts itself)."""


@dataclass(frozen=True)
class Deferred:
    """A patch's new object that is defined only once its target's package is importable: the
    attribute ``attr`` of module ``module``, imported when the patch is installed (at the target
    module's import, or at apply when it is imported already).

    Why: a replacement class that subclasses one of the patched package's own classes cannot be
    defined before that package is imported, while patches are declared (and checked, listed by
    the CLI) without importing it. Compared by value, like every ``Patch.new``."""

    module: str
    attr: str

    def resolve(self) -> Any:
        import importlib

        return getattr(importlib.import_module(self.module), self.attr)

    def __str__(self) -> str:
        return f"{self.module}.{self.attr}"


def resolved(new: Any) -> Any:
    """``new`` itself, or the object a :class:`Deferred` stands for."""
    return new.resolve() if isinstance(new, Deferred) else new


@dataclass(frozen=True)
class Patch:
    """One change to one target.

    target: dotted path, module part then attribute part, e.g.
        ``megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add``.
    kind: see :class:`Kind`.
    new: the replacement object (REPLACE, PROVIDE; a :class:`Deferred` for one defined at install
        time) or the wrapt wrapper ``new(wrapped, instance, args, kwargs)`` (WRAP). Compared by
        value when a feature is applied again: an equal patch is left in place (wrappers built
        from config values are frozen dataclasses for that).
    optional: a missing target is a logged skip instead of an error.
    on_missing: for an optional target whose absence changes behaviour (the feature needs it
        when it exists in this version): called with the reason instead of the info-level skip
        line, e.g. a feature's ``Fallback`` (logged once as a warning; an error under
        ``--strict``, raised where the target was looked for: at apply, or at its module's import).
    why: one line for the patch report.
    global_change: the target lies outside the engine's alias scopes (e.g. a torch function);
        such changes must be declared, and the report lists them.
    module: the module part of ``target``, when it must not be looked up on disk now (a module
        that may only become importable later, e.g. from a Megatron-LM checkout put on sys.path).
        The patch then waits for that module's import.
    update_aliases: replace the other modules' copies of a module-level object too (default).
        False for a name that is deliberately module-local.
    versions: the versions of the target's package this patch applies to, as a PEP 440
        specifier (``">=0.16"``, ``"<0.17"``); None: every version. Outside its versions a patch
        is not applied (not an error: the feature declares another patch for those versions, or
        nothing is needed there). When the version cannot be read the newest layout is assumed.
    after / before: names of other features whose patch of the SAME target this one must sit
        above (wrap: it runs first and calls theirs) / below. Two features patching one target
        must declare their order on at least one side; otherwise the engine refuses the second.
    placeholder: PROVIDE only: tells the stand-in objects a module binds in place of what its
        absent dependency would have given (e.g. ``unittest.mock.MagicMock`` instances).
    counts_as_reached: WRAP only: a call into this wrapper counts as megatron reaching the feature
        (what ``mindspeed-like compare`` and ``testing.reach`` report). False for a hook that runs
        for every model whether or not the feature has work there (a config check), so that a
        dense model does not list an MoE feature as reached.
    """

    target: str
    kind: Kind
    new: Any
    optional: bool = False
    why: str = ""
    global_change: bool = False
    module: str | None = None
    update_aliases: bool = True
    versions: str | None = None
    on_missing: Callable[[str], None] | None = None
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    placeholder: Callable[[Any], bool] | None = None
    counts_as_reached: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise TypeError(f"patch {self.target!r}: kind must be a Kind, got {self.kind!r}")
        for name in ("after", "before"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"patch {self.target!r}: {name} must be a tuple of feature names, got {value!r}")
        if self.placeholder is not None and self.kind is not Kind.PROVIDE:
            raise ValueError(f"patch {self.target!r}: placeholder is for PROVIDE patches")
        if self.on_missing is not None and not self.optional:
            raise ValueError(f"patch {self.target!r}: on_missing is for optional targets (a required one raises)")
        if self.versions is not None:
            try:
                SpecifierSet(self.versions)
            except InvalidSpecifier as error:
                raise ValueError(f"patch {self.target!r}: versions {self.versions!r} is not a specifier") from error

    def specifier(self) -> SpecifierSet | None:
        return None if self.versions is None else SpecifierSet(self.versions, prereleases=True)


@dataclass
class PatchRecord:
    """What the report says about one patch.

    status: "applied" | "pending" (module not imported yet) | "skipped" (optional, missing).
    stack: every feature patching this target, bottom (innermost, applied first) to top.
    """

    feature: str
    target: str
    kind: str
    status: str
    aliases: tuple[str, ...] = ()
    why: str = ""
    global_change: bool = False
    stack: tuple[str, ...] = ()


def pass_through(wrapped, instance, args, kwargs):
    """A WRAP patch's wrapper that changes nothing: the patch stands in the report for a change made
    elsewhere (a finder on ``sys.meta_path``, a ``torch.library`` override), and the engine's call
    counting sees each call of the wrapped function."""
    return wrapped(*args, **kwargs)
