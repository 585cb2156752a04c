"""The training precision of a run, and a feature that cannot act in it.

A feature declares the precisions it acts in (``Feature.precisions``; empty: every one). Where a
run's precision becomes known, the features switched on that cannot act in it are a
:class:`~mindspeed_like.toolkit.errors.LevelConflict`: the runtime makes one that only
``--optimization-level`` switched on step aside (one log line saying why), and one asked for by
name is the error, with the message built here. The precision is known in two places:

* Megatron-LM's parsed arguments (``--bf16`` / ``--fp16``, else fp32), checked before its
  ``validate_args`` (the feature's ``validate_args_hook``, see :func:`precision_checked`), so it
  is said at start-up;
* megatron-core's ``OptimizerConfig`` (``bf16`` / ``fp16``), checked when
  ``get_megatron_optimizer`` is called (``integrations/precision.py``): code that builds its own
  configs (verl, Megatron-Bridge) never goes through Megatron-LM's parser.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from mindspeed_like.toolkit.errors import LevelConflict

PRECISIONS = ("fp32", "fp16", "bf16")
"""Megatron's three training precisions: fp32 (its default), fp16 and bf16 mixed precision."""


class _Option(Protocol):
    @property
    def option(self) -> str: ...

    @property
    def type(self) -> type: ...


class DeclaresPrecisions(Protocol):
    """What this module reads of a :class:`~mindspeed_like.toolkit.declaration.Feature`.

    Said here rather than imported: declaration.py builds every feature's hook with
    :func:`precision_checked`, so this module importing it back, even only for types, would be an
    import cycle (tests/engine/test_import_cycles.py counts type-only imports)."""

    @property
    def name(self) -> str: ...

    @property
    def precisions(self) -> tuple[str, ...]: ...

    @property
    def flags(self) -> Sequence[_Option]: ...


def precision_of(settings: Any) -> str:
    """``bf16`` / ``fp16`` / ``fp32`` from an object with megatron's ``bf16`` and ``fp16`` fields
    (Megatron-LM's args, ``OptimizerConfig``, ``TransformerConfig``)."""
    if getattr(settings, "bf16", False):
        return "bf16"
    return "fp16" if getattr(settings, "fp16", False) else "fp32"


MEGATRON_LM_SPELLING = {"bf16": "--bf16", "fp16": "--fp16", "fp32": "neither --bf16 nor --fp16"}
CONFIG_SPELLING = {"bf16": "bf16=True", "fp16": "fp16=True", "fp32": "neither bf16 nor fp16"}


def conflicts(features: Iterable[DeclaresPrecisions], precision: str, spelling: dict[str, str]) -> list[LevelConflict]:
    """One :class:`LevelConflict` per feature that cannot act in ``precision``."""
    return [conflict(f, precision, spelling) for f in features if f.precisions and precision not in f.precisions]


def conflict(feature: DeclaresPrecisions, precision: str, spelling: dict[str, str]) -> LevelConflict:
    acts_in = " or ".join(feature.precisions)
    given = f"{precision} ({spelling[precision]})"
    option = next((flag.option for flag in feature.flags if flag.type is bool), f"feature '{feature.name}'")
    message = (
        f"{option} acts only in {acts_in} training, but this run trains in {given}. "
        f"Train in {acts_in} ({' or '.join(spelling[p] for p in feature.precisions)}) or switch the feature off "
        f"(drop {option})."
    )
    return LevelConflict(
        feature.name, given, message, reason=f"it acts only in {acts_in} training; this run trains in {given}"
    )


def precision_checked(feature: DeclaresPrecisions, hook: Any = None):
    """``feature``'s validate_args hook with the precision check first: a run in a precision the
    feature cannot act in raises its :class:`LevelConflict` before Megatron-LM validates (each
    step-aside starts validation again, without the feature). Composed once (``Feature``'s
    ``__post_init__``; a ``dataclasses.replace`` copy keeps the same hook)."""
    if getattr(hook, "precision_checked", None) == feature.name:
        return hook

    @contextlib.contextmanager
    def checked(args: Any) -> Iterator[None]:
        found = conflicts((feature,), precision_of(args), MEGATRON_LM_SPELLING)
        if found:
            raise found[0]
        if hook is None:
            yield
            return
        with hook(args):
            yield

    checked.precision_checked = feature.name
    checked.__wrapped__ = hook
    return checked
