"""``--optimization-level 0|1|2``: MindSpeed's levels, as sets of features switched on at once.

A feature declares the lowest level that switches it on (``Feature.optimization_level``); a level
sets the ``switch_on`` values of its members and the ``off_values`` of every other leveled
feature. It fills only flags still at their default: a flag given anywhere (env, argv,
Megatron-LM's args, configure()) overrides the level, ``--no-<flag>`` included (keep a level, one
of its features off). Device adapters and fixes have no level: they run at every level, as in
MindSpeed's level 0.

An explicit flag also wins where a member conflicts with it (a declared ``conflicts`` with a
feature asked for by name, or a :class:`~mindspeed_like.toolkit.errors.LevelConflict` raised by a
check, e.g. megatron's ``--use-precision-aware-optimizer`` against reuse-fp32-param): the member
the level switched on *steps aside* (the runtime logs one line and resolves again with it off).
A level means "where it applies"; two explicit flags in conflict stay an error.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from mindspeed_like.toolkit.declaration import Feature

LEVELS: dict[int, str] = {
    0: "device adapters and fixes only: megatron-core's own paths, made to run on this host",
    1: "+ every feature whose results equal megatron's bitwise or within fp32 rounding",
    2: "+ the features that trade numerics or time for memory",
}

RULE = (
    "level 1 = results bitwise or within fp32 rounding of megatron's own path; "
    "level 2 = also trades numerics or time for memory; adapters and fixes run at every level"
)


def members(level: int, features: Iterable[Feature]) -> list[Feature]:
    """The leveled features that ``level`` switches on."""
    return [f for f in features if f.optimization_level is not None and f.optimization_level <= level]


def flag_values(level: int, features: Iterable[Feature], stepped_aside: Collection[str] = ()) -> dict[str, Any]:
    """The flag values ``level`` stands for: members on, every other leveled feature off.

    stepped_aside: members that yielded to an explicit flag: off as if not members."""
    if level not in LEVELS:
        raise ValueError(f"optimization level {level!r} is not one of {sorted(LEVELS)}")
    values: dict[str, Any] = {}
    for feature in features:
        if feature.optimization_level is None:
            continue
        member = feature.optimization_level <= level and feature.name not in stepped_aside
        values.update(feature.switch_on if member else feature.off_values)
    return values


def set_by_level(feature: Feature, sources: Mapping[str, str]) -> bool:
    """Whether ``feature``'s switch is the level's doing: every flag of its ``switch_on`` came from
    ``--optimization-level`` (``sources``: a Config's flag -> source), none was given by name."""
    return (
        feature.optimization_level is not None
        and bool(feature.switch_on)
        and all(sources.get(name) == "optimization-level" for name in feature.switch_on)
    )
