"""context-parallel (on wherever megatron's config has ``context_parallel_size > 1``): megatron-core's
local-spec attention over a sequence split across ranks, without TransformerEngine. Algorithms
(MindSpeed's spellings, ``--context-parallel-algo``): ``megatron_cp_algo`` (ring, default),
``ulysses_cp_algo``, ``hybrid_cp_algo`` (``--ulysses-degree-in-cp N``), ``kvallgather_cp_algo``.
Targets and coverage: ``attention.py``; hybrid's process groups (megatron's hierarchical CP groups,
sized from the degree at ``initialize_model_parallel``): ``groups.py``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.context_parallel.attention import (
    ContextParallelForward,
    ContextParallelUnsupported,
    construct,
    flash_at_cp_message,
)
from mindspeed_like.features.context_parallel.groups import (
    HYBRID,
    INITIALIZE_MODEL_PARALLEL,
    HierarchicalGroups,
    check_initialized,
    check_megatron_args,
)
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.fallback import Fallback
from mindspeed_like.toolkit.targets import DOT_PRODUCT_ATTENTION

NAME = "context-parallel"
FLASH = "flash-attention"
CHOICES = ("megatron_cp_algo", "ulysses_cp_algo", "hybrid_cp_algo", "kvallgather_cp_algo")


def patches(ctx: Context) -> list[Patch]:
    result = [
        Patch(
            f"{DOT_PRODUCT_ATTENTION}.DotProductAttention.__init__",
            Kind.WRAP,
            construct,
            why="the local spec's attention asserts context_parallel_size == 1 in its constructor",
            after=("cpu-adapter",),
        ),
        Patch(
            f"{DOT_PRODUCT_ATTENTION}.DotProductAttention.forward",
            Kind.WRAP,
            ContextParallelForward(
                ctx["context_parallel_algo"],
                ctx["ulysses_degree_in_cp"],
                ctx.fallback(FLASH) if FLASH in ctx.enabled_names else None,
            ),
            why="attention over the CP ranks' zigzag chunks (CP == 1: megatron's or flash-attention's call)",
            after=("flash-attention",),
        ),
    ]
    if ctx["context_parallel_algo"] == HYBRID:
        result.append(
            Patch(
                INITIALIZE_MODEL_PARALLEL,
                Kind.WRAP,
                HierarchicalGroups(ctx["ulysses_degree_in_cp"]),
                why="hybrid_cp_algo's Ulysses/ring groups are megatron's hierarchical CP groups, sized "
                "[N, CP/N] from --ulysses-degree-in-cp (megatron builds them only when given the sizes)",
            )
        )
    return result


@contextlib.contextmanager
def megatron_args_hook(args) -> Iterator[None]:
    """validate_args hook (Megatron-LM): hybrid's groups (``groups.check_megatron_args``), and at
    start-up, once (rank 0), that ``--use-flash-attn`` at ``--context-parallel-size`` > 1 is computed
    by the context-parallel kernel (its flash kernel is not called there: nothing would say so)."""
    with check_megatron_args(args):
        cp_size = int(getattr(args, "context_parallel_size", 1) or 1)
        if cp_size > 1 and getattr(args, "use_flash_attn", False):
            algorithm = getattr(args, "context_parallel_algo", CHOICES[0])
            Fallback(FLASH, strict=False).served_by(
                NAME, flash_at_cp_message(cp_size, algorithm), say=getattr(args, "rank", 0) == 0
            )
        yield


def validate(ctx: Context) -> None:
    algo, degree = ctx["context_parallel_algo"], ctx["ulysses_degree_in_cp"]
    if algo not in CHOICES:  # argparse's choices catch the command line; configure() comes here
        raise ConfigError(f"--context-parallel-algo {algo!r} is not one of {', '.join(CHOICES)}")
    if algo == HYBRID and (degree is None or degree < 1):
        raise ConfigError(
            "--context-parallel-algo hybrid_cp_algo needs --ulysses-degree-in-cp N (the Ulysses group size, a "
            f"divisor of --context-parallel-size), got {degree}"
        )
    if algo != HYBRID and degree is not None:
        raise ConfigError("--ulysses-degree-in-cp applies only to --context-parallel-algo hybrid_cp_algo")
    if algo == HYBRID:
        check_initialized(degree)  # configure() after megatron's parallel state exists


FEATURE = Feature(
    name=NAME,
    summary="context parallelism without TransformerEngine: ring, Ulysses and all-gather-KV attention",
    patches=patches,
    flags=(
        Flag(
            "context_parallel_algo",
            str,
            "megatron_cp_algo",
            "attention algorithm at megatron's --context-parallel-size > 1: megatron_cp_algo (ring), "
            "ulysses_cp_algo (all-to-all over heads), hybrid_cp_algo (Ulysses inside, ring across), "
            "kvallgather_cp_algo (all-gather K/V)",
            choices=CHOICES,
        ),
        Flag(
            "ulysses_degree_in_cp",
            int,
            None,
            "hybrid_cp_algo: the Ulysses group size inside each context-parallel group (a divisor of "
            "--context-parallel-size; N=1 is ring alone, N=CP Ulysses alone); megatron's hierarchical CP groups "
            "[N, CP/N] are built from it (no --hierarchical-context-parallel-sizes needed)",
        ),
        Flag(
            "no_portable_context_parallel",
            bool,
            False,
            "off switch: keep megatron's local attention at context_parallel_size > 1 (its 'only supported by "
            "TEDotProductAttention' assertion), e.g. when TransformerEngine's attention is used",
        ),
    ),
    enabled=lambda ctx: not ctx["no_portable_context_parallel"],
    validate=validate,
    validate_args_hook=megatron_args_hook,
    backend="portable",
    switched_by="megatron's --context-parallel-size > 1 (off: --no-portable-context-parallel)",
)

__all__ = ["FEATURE", "ContextParallelUnsupported"]
