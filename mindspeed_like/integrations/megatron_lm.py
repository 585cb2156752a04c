"""Megatron-LM's command line knows our flags, and features hook its argument validation.

Targets (``megatron.training.arguments``; Megatron-LM checkouts, and the megatron-core wheel from
0.17): both optional, waiting for that module's import.

* ``parse_args(extra_args_provider=None, ignore_unknown_args=False)`` builds Megatron-LM's
  parser, lets an ``extra_args_provider`` add options, and parses ``sys.argv``. The wrapper
  chains a provider that adds every mindspeed_like option the parser does not have yet
  (options Megatron defines itself, such as ``--use-flash-attn``, are not defined twice: their
  value is read from Megatron's parsed args). After parsing, the explicitly given values become
  the config's "megatron-args" source (the runtime re-applies through ``Context.megatron_args_sink``),
  and our options are written onto ``args`` with their final values.
* ``validate_args(args, defaults={})``: ONE wrap serves every feature. Each switched-on feature
  may declare a ``validate_args_hook`` (a context manager around the call: adjust the parsed
  args before validation, check the validated ones after); they run in feature-name order.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mindspeed_like.config import add_flag
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.declaration import Context, Feature, Flag, ValidateArgsHook, always_on
from mindspeed_like.toolkit.errors import FeatureUnsupported
from mindspeed_like.toolkit.targets import TRAINING_ARGUMENTS


@dataclass(frozen=True)
class ParseArgs:
    """Wrapper of ``parse_args``: our flags on Megatron-LM's parser, their values to the runtime."""

    flags: tuple[Flag, ...]
    sink: Callable[[dict[str, Any]], Context] | None

    def __call__(self, wrapped, instance, args, kwargs):
        call = Call(wrapped, args, kwargs)
        user_provider = call["extra_args_provider"]
        ours: list[Flag] = []
        megatrons: dict[str, argparse.Action] = {}  # flag name -> Megatron's own option

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
            return parser

        namespace = call(extra_args_provider=provider)
        given = {flag.name: getattr(namespace, flag.name) for flag in ours if flag.name in vars(namespace)}
        for name, action in megatrons.items():
            value = getattr(namespace, action.dest, action.default)
            if value != action.default:
                given[name] = value
        if self.sink is None:
            return namespace
        ctx = self.sink(given)
        for flag in ours:
            setattr(namespace, flag.name, ctx.config[flag.name])
        _announce(ctx.enabled_names, getattr(namespace, "rank", 0))
        return namespace


@dataclass(frozen=True)
class ValidateArgs:
    """Wrapper of ``validate_args``: the switched-on features' hooks around the one call."""

    hooks: tuple[tuple[str, ValidateArgsHook], ...]

    def __call__(self, wrapped, instance, args, kwargs):
        namespace = Call(wrapped, args, kwargs)["args"]
        with contextlib.ExitStack() as stack:
            for _, hook in self.hooks:
                stack.enter_context(hook(namespace))
            return wrapped(*args, **kwargs)


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
    hooks = tuple(sorted((f.name, f.validate_args_hook) for f in ctx.features if f.validate_args_hook is not None))
    # Optional: the module exists only with Megatron-LM's loop; once it is imported, a missing
    # function means our flags or the features' hooks would be silently ignored: logged (strict: error).
    missing = ctx.fallback(
        "megatron-lm-arguments", MegatronLmArgumentsUnsupported, "mindspeed_like flags are not on Megatron-LM's parser"
    )
    result = [
        Patch(
            f"{TRAINING_ARGUMENTS}.parse_args",
            Kind.WRAP,
            ParseArgs(ctx.flags, ctx.megatron_args_sink),
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
                ValidateArgs(hooks),
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
