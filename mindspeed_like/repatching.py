"""MindSpeed's client API: ``repatch(args)`` with megatron's arguments, as ms-swift and verl call it.

MindSpeed's ``mindspeed.megatron_adaptor.repatch(args)`` takes a dict of megatron's arguments,
sets each on its full argument namespace and re-applies every feature from it. Its clients call it
once they have built megatron's arguments in code, after the import line already applied the
features of the command line: ms-swift with ``asdict()`` of its whole Megatron argument dataclass
(``swift/model/npu_patch/mindspeed.py`` ``apply_mindspeed_patches``), verl with its
``override_transformer_config`` (an omegaconf ``DictConfig``).

Here the same call feeds the config's "megatron-args" source (the one Megatron-LM's parsed
command line feeds, ``integrations/megatron_lm.py``), then the runtime re-applies: each of our
flags present in ``args``, under its name or MindSpeed's spelling, takes that value (above
MINDSPEED_LIKE_ARGS and the command line, below ``configure()``), as MindSpeed's repatch sets it
on its namespace; a present ``None`` unsets it; flags absent keep the value they had. Every other
key is megatron's or the client's own and is left to them (a whole argument dict holds hundreds).
Patches of features switched off are removed, those switched on applied, unchanged ones left.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from mindspeed_like import runtime
from mindspeed_like.config import Config, check_value
from mindspeed_like.toolkit.declaration import Flag
from mindspeed_like.toolkit.errors import ConfigError

SOURCE = "repatch()"


@dataclasses.dataclass(frozen=True)
class Repatched:
    """What a ``repatch()`` changed.

    flags: each flag whose resolved value changed, as (before, after).
    switched_on / switched_off: the features that were switched on / off by it.
    config: the resolved config now.
    True when anything changed (``if repatch(args): ...``), False for a call that changed nothing.
    """

    flags: dict[str, tuple[Any, Any]]
    switched_on: tuple[str, ...]
    switched_off: tuple[str, ...]
    config: Config

    def __bool__(self) -> bool:
        return bool(self.flags or self.switched_on or self.switched_off)


def _as_mapping(args: object) -> Mapping[Any, Any]:
    if isinstance(args, Mapping):
        return args
    if isinstance(args, (argparse.Namespace, types.SimpleNamespace)):
        return vars(args)
    hint = ""
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        hint = " (a dataclass: pass dataclasses.asdict(args), as ms-swift does)"
    raise TypeError(
        f"{SOURCE}: expected megatron's arguments as a dict (any Mapping, e.g. omegaconf's DictConfig) or an "
        f"argparse.Namespace, got {type(args).__module__}.{type(args).__qualname__}{hint}"
    )


def _keys_of(flag: Flag) -> tuple[str, ...]:
    """The argument names ``flag`` is read under: its name and MindSpeed's spelling (argparse's
    ``dest`` of each option). A generic flag (``--device``, ``--strict``) only as
    ``mindspeed_<name>``: a client's own ``device`` or ``strict`` argument is not ours."""
    return tuple(dict.fromkeys(option.lstrip("-").replace("-", "_") for option in flag.argv_option_strings))


def flag_values(args: Mapping[str, Any] | argparse.Namespace) -> dict[str, Any]:
    """Our flags' values in megatron's argument dict ``args``: flag name -> value (``None``:
    present as None, i.e. unset). Values are checked against the flag's type and choices here
    (ConfigError naming the argument); a flag given under two spellings must agree."""
    mapping = _as_mapping(args)
    found: dict[str, tuple[str, Any]] = {}
    for flag in runtime.flags():
        for key in _keys_of(flag):
            if key not in mapping:
                continue
            raw = mapping[key]
            value = None if raw is None else check_value(flag, raw, f"{SOURCE} argument {key!r}")
            if flag.name in found and found[flag.name][1] != value:
                other, before = found[flag.name]
                raise ConfigError(
                    f"{SOURCE}: {other}={before!r} and {key}={value!r} are two spellings of flag {flag.name!r} "
                    "with different values; pass one"
                )
            found[flag.name] = (key, value)
    return {name: value for name, (_, value) in found.items()}


def repatch(args: Mapping[str, Any] | argparse.Namespace) -> Repatched:
    """Re-apply the features megatron's arguments ``args`` switch on (MindSpeed's ``repatch``).

    ``args``: megatron's arguments as ms-swift and verl pass them, a dict (any Mapping) or an
    ``argparse.Namespace``; keys that are none of our flags are ignored. Returns what changed.
    Raises TypeError for another type, ConfigError for a bad value or a conflict, and then
    nothing changed."""
    values = flag_values(args)
    before = runtime.current_context()
    merged = runtime.megatron_args()
    for name, value in values.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    after = runtime.set_megatron_args(merged)
    changed = {
        name: (before.config[name], after.config[name])
        for name in after.config
        if name in before.config and before.config[name] != after.config[name]
    }
    was, now = set(before.enabled_names), set(after.enabled_names)
    return Repatched(
        flags=changed,
        switched_on=tuple(n for n in after.enabled_names if n not in was),
        switched_off=tuple(n for n in before.enabled_names if n not in now),
        config=after.config,
    )
