"""Megatron-LM's command line knows our flags, and features hook its argument validation.

Targets (``megatron.training.arguments``; Megatron-LM checkouts, and the megatron-core wheel from
0.17): both optional, waiting for that module's import.

* ``parse_args(extra_args_provider=None, ignore_unknown_args=False)`` builds Megatron-LM's
  parser, lets an ``extra_args_provider`` add options, and parses ``sys.argv``. The wrapper
  chains a provider that adds every mindspeed_like option the parser does not have yet
  (options Megatron defines itself, such as ``--use-flash-attn``, are not defined twice: their
  value is read from Megatron's parsed args), and ``--no-<flag>`` for every feature's on switch
  (``config.negatable``; one Megatron defines itself is left to it). After parsing, the
  explicitly given values become the config's "megatron-args" source (the runtime re-applies
  through ``Context.megatron_args_sink``), and our options are written onto ``args`` with their
  final values.
* ``validate_args(args, defaults={})``: ONE wrap serves every feature. Each switched-on feature
  may declare a ``validate_args_hook`` (a context manager around the call: adjust the parsed
  args before validation, check the validated ones after); they run in feature-name order. A hook
  that finds a feature in conflict with an explicit flag raises a ``LevelConflict`` before
  validation: handed to the runtime, a feature ``--optimization-level`` switched on steps aside
  (our values on ``args`` are rewritten, the hooks run again from the new Context), and one asked
  for by name makes it the error. The "features on" line is printed here, once the hooks accepted
  the arguments (by ``parse_args`` when no feature has a hook), so it is the final one.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mindspeed_like.config import add_flag, add_negation, negatable, negation_option
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.declaration import Context, Feature, Flag, ValidateArgsHook, always_on
from mindspeed_like.toolkit.errors import ConfigError, FeatureUnsupported, LevelConflict
from mindspeed_like.toolkit.targets import TRAINING_ARGUMENTS
from mindspeed_like.toolkit.uncaught import message_only


@dataclass(frozen=True)
class ParseArgs:
    """Wrapper of ``parse_args``: our flags on Megatron-LM's parser, their values to the runtime."""

    flags: tuple[Flag, ...]
    sink: Callable[[dict[str, Any]], Context] | None
    announce: bool = True  # False: validate_args is wrapped and prints the features line (final by then)

    def __call__(self, wrapped, instance, args, kwargs):
        try:
            return self._parse(wrapped, args, kwargs)
        except ConfigError as error:  # ends the run: its message, not a traceback (toolkit/uncaught.py)
            raise message_only(error) from None

    def _parse(self, wrapped, args, kwargs):
        call = Call(wrapped, args, kwargs)
        user_provider = call["extra_args_provider"]
        ours: list[Flag] = []
        megatrons: dict[str, argparse.Action] = {}  # flag name -> Megatron's own option
        negated: dict[str, str] = {}  # flag name -> marker attribute of its --no- (Megatron owns the flag)

        def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            if user_provider is not None:
                parser = user_provider(parser)
            group = parser.add_argument_group("mindspeed_like", "mindspeed_like features (`mindspeed-like features`)")
            for flag in self.flags:
                known = [o for o in flag.option_strings if o in parser._option_string_actions]
                if known:
                    megatrons[flag.name] = parser._option_string_actions[known[0]]
                    continue
                add_flag(group, flag)
                ours.append(flag)
            for flag in negatable(self.flags):
                if negation_option(flag) in parser._option_string_actions:
                    continue  # Megatron's own --no- option: its meaning, not ours
                marker = f"_mindspeed_like_no_{flag.name}" if flag.name in megatrons else None
                if marker and megatrons[flag.name].dest != flag.name:
                    continue  # the marker's action writes the flag's name: Megatron's attribute must be it
                add_negation(group, flag, marker)
                if marker:
                    negated[flag.name] = marker
            return parser

        namespace = call(extra_args_provider=provider)
        given = {flag.name: getattr(namespace, flag.name) for flag in ours if flag.name in vars(namespace)}
        for name, action in megatrons.items():
            value = getattr(namespace, action.dest, action.default)
            if value != action.default:
                given[name] = value
        for name, marker in negated.items():
            if vars(namespace).pop(marker, False):
                given[name] = getattr(namespace, megatrons[name].dest)  # False unless --<flag> came later
        if self.sink is None:
            return namespace
        ctx = self.sink(given)
        for flag in ours:
            setattr(namespace, flag.name, ctx.config[flag.name])
        if self.announce:
            _announce(ctx.enabled_names, getattr(namespace, "rank", 0))
        return namespace


@dataclass(frozen=True)
class ValidateArgs:
    """Wrapper of ``validate_args``: the switched-on features' hooks around the one call.

    resolve_conflict: the runtime's (``Context.resolve_conflict``); a hook's ``LevelConflict``
    raised before validation goes there, and validation starts again with the new Context's hooks.
    features: the switched-on features, printed (rank 0) once the hooks accepted the arguments,
    so the line Megatron's log shows is the final one.
    """

    hooks: tuple[tuple[str, ValidateArgsHook], ...]
    resolve_conflict: Callable[[LevelConflict], Context] | None = None
    features: tuple[str, ...] = ()

    def __call__(self, wrapped, instance, args, kwargs):
        try:
            return self._validate(wrapped, args, kwargs)
        except ConfigError as error:  # ends the run: its message, not a traceback (toolkit/uncaught.py)
            raise message_only(error) from None

    def _validate(self, wrapped, args, kwargs):
        namespace = Call(wrapped, args, kwargs)["args"]
        hooks, features = self.hooks, list(self.features)
        for _ in range(len(hooks) + 1):
            validating = False
            try:
                with contextlib.ExitStack() as stack:
                    for _, hook in hooks:
                        stack.enter_context(hook(namespace))
                    validating = True
                    _announce(features, getattr(namespace, "rank", 0))
                    return wrapped(*args, **kwargs)
            except LevelConflict as conflict:
                if validating or self.resolve_conflict is None:
                    raise
                ctx = self.resolve_conflict(conflict)  # raises it unless a level's feature stepped aside
                for flag in ctx.flags:
                    if not flag.megatron_defines and hasattr(namespace, flag.name):
                        setattr(namespace, flag.name, ctx.config[flag.name])
                hooks, features = hooks_of(ctx), ctx.enabled_names
        raise ConfigError("mindspeed_like: validate_args hooks kept conflicting")  # pragma: no cover


def hooks_of(ctx: Context) -> tuple[tuple[str, ValidateArgsHook], ...]:
    """The switched-on features' validate_args hooks, in feature-name order."""
    return tuple(sorted((f.name, f.validate_args_hook) for f in ctx.features if f.validate_args_hook is not None))


_announced: list[list[str]] = []


def _announce(names: list[str], rank: int) -> None:
    """One line in Megatron's start-up log (rank 0), like its own; again only if it changes
    (Megatron-LM may parse its arguments more than once per process)."""
    if rank == 0 and (not _announced or _announced[-1] != names):
        _announced.append(names)
        print(f"> mindspeed_like features on: {', '.join(names)}", flush=True)


class MegatronLmArgumentsUnsupported(FeatureUnsupported):
    """``strict`` is on and Megatron-LM's arguments module lacks what the integration wraps."""


def patches(ctx: Context) -> list[Patch]:
    hooks = hooks_of(ctx)
    # Optional: the module exists only with Megatron-LM's loop; once it is imported, a missing
    # function means our flags or the features' hooks would be silently ignored: logged (strict: error).
    missing = ctx.fallback(
        "megatron-lm-arguments", MegatronLmArgumentsUnsupported, "mindspeed_like flags are not on Megatron-LM's parser"
    )
    result = [
        Patch(
            f"{TRAINING_ARGUMENTS}.parse_args",
            Kind.WRAP,
            ParseArgs(ctx.flags, ctx.megatron_args_sink, announce=not hooks),
            optional=True,
            on_missing=missing,
            module=TRAINING_ARGUMENTS,
            why="Megatron-LM's parser accepts mindspeed_like flags; their values feed the config",
        )
    ]
    if hooks:
        result.append(
            Patch(
                f"{TRAINING_ARGUMENTS}.validate_args",
                Kind.WRAP,
                ValidateArgs(hooks, ctx.resolve_conflict, tuple(ctx.enabled_names)),
                optional=True,
                on_missing=missing,
                module=TRAINING_ARGUMENTS,
                why="features' checks and adjustments around validation: " + ", ".join(name for name, _ in hooks),
            )
        )
    return result


FEATURE = Feature(
    name="megatron-lm-arguments",
    summary="Megatron-LM's parse_args knows mindspeed_like flags; validate_args runs the features' hooks",
    patches=patches,
    enabled=always_on,
    backend="any",
    kind="integration",
)
