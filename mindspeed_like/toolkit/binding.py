"""The arguments of a wrapped megatron call, by name, per the INSTALLED function's signature.

megatron adds, removes and reorders parameters between releases; a wrapper that unpacks
``args`` by position or copies megatron's parameter list breaks silently when that happens.
``Call`` binds ``(args, kwargs)`` with ``inspect.signature`` of the function being wrapped
(cached per function), so a wrapper reads ``call["sequence_parallel"]`` whatever the position,
and re-calls megatron with one argument changed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any


@functools.lru_cache(maxsize=4096)
def _signature(function: Callable, bound: bool) -> inspect.Signature:
    signature = inspect.signature(function)
    if bound:  # a method accessed on an instance: its first parameter is taken
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


def signature_of(wrapped: Callable) -> inspect.Signature:
    """``inspect.signature(wrapped)``, cached by the underlying function."""
    function = getattr(wrapped, "__func__", None)
    if function is not None and getattr(wrapped, "__self__", None) is not None:
        return _signature(function, True)
    return _signature(wrapped, False)


_EMPTY = inspect.Parameter.empty
_SIMPLE_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


_LAYOUTS: dict[int, tuple[inspect.Signature, Any]] = {}


def _plain_layout(signature: inspect.Signature) -> tuple[tuple[str, ...], int, dict[str, Any]] | None:
    """(names in order, how many may come by position, defaults) for a signature made only of
    ordinary and keyword-only parameters; None for anything else (``*args``, ``**kwargs``,
    positional-only), which ``inspect`` binds. Cached by identity (hashing a Signature hashes all
    its parameters: slower than binding)."""
    entry = _LAYOUTS.get(id(signature))
    if entry is None or entry[0] is not signature:
        entry = _LAYOUTS[id(signature)] = (signature, _layout(signature))
    return entry[1]


def _layout(signature: inspect.Signature) -> tuple[tuple[str, ...], int, dict[str, Any]] | None:
    parameters = list(signature.parameters.values())
    if any(p.kind not in _SIMPLE_KINDS for p in parameters):
        return None
    positional = sum(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)
    defaults = {p.name: p.default for p in parameters if p.default is not _EMPTY}
    return tuple(p.name for p in parameters), positional, defaults


def _bind(signature: inspect.Signature, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """``signature.bind(*args, **kwargs)`` with the defaults applied.

    Wrappers on a training step's hot path bind every call; ``Signature.bind`` costs ~10-20 us of
    host time each, which a GPU waiting on the host pays. Plain signatures (megatron's, almost
    always) are bound by a direct mapping here; anything unusual, and every malformed call (so the
    error is ``inspect``'s own ``TypeError``), goes through ``inspect``."""
    layout = _plain_layout(signature)
    if layout is not None:
        names, positional, defaults = layout
        if len(args) <= positional and all(name in defaults or name in kwargs for name in names[len(args) :]):
            given = dict(zip(names, args))
            if not any(name in given for name in kwargs) and all(name in names for name in kwargs):
                given.update(kwargs)
                return inspect.BoundArguments(
                    signature, {name: given[name] if name in given else defaults[name] for name in names}
                )
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


class Call:
    """One call of ``wrapped`` with ``(args, kwargs)``, bound by name (defaults filled in)."""

    def __init__(self, wrapped: Callable, args: tuple, kwargs: dict) -> None:
        self.wrapped = wrapped
        self._bound = _bind(signature_of(wrapped), args, kwargs)

    def __getitem__(self, name: str) -> Any:
        return self._bound.arguments[name]

    def __contains__(self, name: str) -> bool:
        return name in self._bound.arguments

    def get(self, name: str, default: Any = None) -> Any:
        """An argument that not every megatron version has: ``default`` where it is absent."""
        return self._bound.arguments.get(name, default)

    @property
    def arguments(self) -> dict[str, Any]:
        return dict(self._bound.arguments)

    def __call__(self, **changes: Any) -> Any:
        """Call ``wrapped`` with these arguments, ``changes`` replacing some of them by name."""
        unknown = [name for name in changes if name not in self._bound.arguments]
        if unknown:
            raise TypeError(f"{getattr(self.wrapped, '__qualname__', self.wrapped)} has no parameter {unknown}")
        bound = inspect.BoundArguments(self._bound.signature, dict(self._bound.arguments))
        bound.arguments.update(changes)
        return self.wrapped(*bound.args, **bound.kwargs)


def accepted(function: Callable, **optional: Any) -> dict[str, Any]:
    """The keyword arguments among ``optional`` that the installed ``function`` takes: for
    arguments a newer megatron release added (e.g. ``tp_group=``), passed where they exist."""
    parameters = signature_of(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optional)
    return {name: value for name, value in optional.items() if name in parameters}
