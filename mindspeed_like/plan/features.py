"""The features arm's switches: this library's flags resolved as a run would resolve them.

Flags come from the command line (``--use-flash-attn``, ``--optimization-level 2``, ...),
``MINDSPEED_LIKE_ARGS`` and, for compare's options, the parsed values. No feature flag given means
level 2, as `mindspeed-like compare` does (every feature that applies); the plan says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mindspeed_like.plan.paths import Paths, feature_paths
from mindspeed_like.plan.spec import Run

DEFAULT_LEVEL = 2


@dataclass(frozen=True)
class Switches:
    config: Mapping[str, Any]
    enabled: tuple[str, ...]  # the accelerations switched on (kind "feature")
    level: int | None
    defaulted: bool  # no feature flag was given: level 2 stands in

    def given(self) -> dict[str, Any]:
        """The flag values not at their defaults (the level's included)."""
        return {name: self.config[name] for name, source in self.config.sources.items() if source != "default"}

    def paths(self, run: Run) -> Paths:
        return feature_paths(run, self.enabled, self.config)


def resolve(argv: Sequence[str] | None = None, values: Mapping[str, Any] | None = None) -> Switches:
    """Our flags from ``argv`` (a Megatron-LM command line: its own options pass through) or from
    already-parsed ``values``; level 2 when neither switches anything."""
    from mindspeed_like import runtime
    from mindspeed_like.compare.arguments import SHARED_FLAGS

    values = dict(values or {})
    _check_our_values(argv or [])
    config = runtime.resolve_config(code=values, argv=list(argv or []))
    given = {name for name, source in config.sources.items() if source not in ("default", "optimization-level")}
    defaulted = not (given - set(SHARED_FLAGS)) and config["optimization_level"] is None
    if defaulted:
        values["optimization_level"] = DEFAULT_LEVEL
        config = runtime.resolve_config(code=values, argv=list(argv or []))
    ctx = runtime.context_for(config)
    runtime.check_relations(ctx)
    enabled = tuple(f.name for f in ctx.features if f.kind == "feature")
    return Switches(config=config, enabled=enabled, level=config["optimization_level"], defaulted=defaulted)


def _check_our_values(argv: Sequence[str]) -> None:
    """Our flags' values in a plan's command line, refused when wrong. A training script's command
    line only warns and keeps going (the script owns it, config.parse_argv); every option of a plan's
    is meant for the plan, so ``--optimization-level 3`` is an error, not level 2 by default."""
    from mindspeed_like import config as config_mod
    from mindspeed_like import runtime
    from mindspeed_like.toolkit.errors import ConfigError

    try:
        config_mod.build_parser(runtime.flags(), argv=True).parse_known_args(list(argv))
    except ConfigError as error:
        raise ConfigError(f"plan: {str(error).removeprefix('mindspeed_like: ')}") from None
