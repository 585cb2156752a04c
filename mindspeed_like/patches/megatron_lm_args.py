"""Megatron-LM's command line knows our flags.

Target: ``megatron.training.arguments.parse_args(extra_args_provider=None,
ignore_unknown_args=False)``, which builds Megatron-LM's parser, lets an
``extra_args_provider`` add options, and parses ``sys.argv``. It exists only in
Megatron-LM checkouts (megatron.training is not in the megatron-core wheel), so the
patch is optional and waits for that module's import.

The wrapper chains an extra_args_provider that adds every mindspeed_like option the
parser does not have yet (options Megatron defines itself, such as ``--use-flash-attn``,
are not defined twice: their value is read from Megatron's parsed args). After parsing,
the explicitly given values become the config's "megatron-args" source, the patches are
re-applied, and our own options are written onto ``args`` with their final values so
Megatron code and user code see one consistent namespace.
"""

from __future__ import annotations

import argparse

from mindspeed_like.config import add_flag
from mindspeed_like.features.base import Feature, always_on
from mindspeed_like.patching import Kind, Patch

ARGUMENTS_MODULE = "megatron.training.arguments"


def _parse_args_with_our_flags(wrapped, instance, args, kwargs):
    from mindspeed_like import runtime

    bound = _bind(*args, **kwargs)
    user_provider = bound["extra_args_provider"]
    ours: list = []
    megatrons: dict[str, object] = {}  # flag name -> Megatron's own default

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if user_provider is not None:
            parser = user_provider(parser)
        group = parser.add_argument_group("mindspeed_like", "mindspeed_like features (see `mindspeed-like features`)")
        for flag in runtime.flags():
            known = [o for o in flag.option_strings if o in parser._option_string_actions]
            if known:
                megatrons[flag.name] = parser._option_string_actions[known[0]]
                continue
            add_flag(group, flag)
            ours.append(flag)
        return parser

    bound["extra_args_provider"] = provider
    namespace = wrapped(**bound)
    given = {}
    for flag in ours:
        if flag.name in vars(namespace):
            given[flag.name] = getattr(namespace, flag.name)
    for name, action in megatrons.items():
        value = getattr(namespace, action.dest, action.default)
        if value != action.default:
            given[name] = value
    config = runtime.set_megatron_args(given)
    for flag in ours:
        setattr(namespace, flag.name, config[flag.name])
    _announce(runtime.enabled_feature_names(config), getattr(namespace, "rank", 0))
    return namespace


_announced: list[list[str]] = []


def _announce(names: list[str], rank: int) -> None:
    """One line in Megatron's start-up log (rank 0), like its own; again only if it changes
    (Megatron-LM may parse its arguments more than once per process)."""
    if rank == 0 and (not _announced or _announced[-1] != names):
        _announced.append(names)
        print(f"> mindspeed_like features on: {', '.join(names)}", flush=True)


def _bind(extra_args_provider=None, ignore_unknown_args=False) -> dict:
    return {"extra_args_provider": extra_args_provider, "ignore_unknown_args": ignore_unknown_args}


PATCHES = [
    Patch(
        f"{ARGUMENTS_MODULE}.parse_args",
        Kind.WRAP,
        _parse_args_with_our_flags,
        optional=True,
        module=ARGUMENTS_MODULE,
        why="Megatron-LM's parser accepts mindspeed_like flags; their values feed the config",
    )
]


FEATURE = Feature(
    name="megatron-lm-arguments",
    summary="Megatron-LM's parse_args knows mindspeed_like flags (Megatron-LM checkouts only)",
    patches=PATCHES,
    enabled=always_on,
    backend=lambda config: "any",
)
