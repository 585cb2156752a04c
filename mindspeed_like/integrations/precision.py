"""precision-check: features that cannot act in a run's precision, checked where megatron-core
learns it from code (``OptimizerConfig.bf16`` / ``fp16``) rather than from Megatron-LM's parser.

Target: ``megatron.core.optimizer.get_megatron_optimizer`` (WRAP; megatron.training and clients
that build their configs in code, verl or Megatron-Bridge, call it; aliases updated). Before
megatron builds the optimizers, each feature ``--optimization-level`` switched on whose
``Feature.precisions`` leave out the config's precision is handed to the runtime as a
``LevelConflict`` (``Context.resolve_conflict``): it steps aside (one log line saying why; its
patches are gone before the optimizer is built). A feature asked for by name is left to its own
refusal where it acts, which names what it met (reuse-fp32-param's: the optimizer megatron built).
Megatron-LM's command line is checked earlier, at validate_args (``toolkit/precision.py``), by
name too; a run that passed that check finds nothing here. No patch when no feature the level
switched on declares precisions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mindspeed_like import levels
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.declaration import Context, Feature, always_on
from mindspeed_like.toolkit.errors import LevelConflict
from mindspeed_like.toolkit.precision import CONFIG_SPELLING, conflicts, precision_of

NAME = "precision-check"
TARGET = "megatron.core.optimizer.get_megatron_optimizer"


@dataclass(frozen=True)
class OptimizerPrecisionCheck:
    """Wrapper of ``get_megatron_optimizer``: features that cannot act in ``config``'s precision
    step aside (or are the error) before the optimizers are built."""

    features: tuple[Feature, ...]  # switched on by the level, with declared precisions
    resolve_conflict: Callable[[LevelConflict], Context]

    def __call__(self, wrapped, instance, args, kwargs):
        precision = precision_of(Call(wrapped, args, kwargs)["config"])
        for found in conflicts(self.features, precision, CONFIG_SPELLING):
            self.resolve_conflict(found)  # the level's feature steps aside
        return wrapped(*args, **kwargs)


def patches(ctx: Context) -> list[Patch]:
    declared = tuple(f for f in ctx.features if f.precisions and levels.set_by_level(f, ctx.config.sources))
    if not declared or ctx.resolve_conflict is None:
        return []
    return [
        Patch(
            TARGET,
            Kind.WRAP,
            OptimizerPrecisionCheck(declared, ctx.resolve_conflict),
            why="level-set features that cannot act in the optimizer config's precision step aside first: "
            + ", ".join(f.name for f in declared),
        )
    ]


FEATURE = Feature(
    name=NAME,
    summary="a feature --optimization-level switched on that cannot act in the run's precision "
    "(fp32/fp16/bf16) steps aside, saying why, when megatron-core builds its optimizer",
    patches=patches,
    enabled=always_on,
    backend="any",
    kind="integration",
)
