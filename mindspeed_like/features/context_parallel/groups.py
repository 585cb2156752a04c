"""hybrid_cp_algo's process groups: megatron's hierarchical context-parallel groups, derived from
``--ulysses-degree-in-cp N`` alone (MindSpeed's spelling; megatron's own is
``--hierarchical-context-parallel-sizes N CP/N``, which a MindSpeed script does not pass).

Target (WRAP): ``megatron.core.parallel_state.initialize_model_parallel``. Every release 0.13-0.19
takes ``hierarchical_context_parallel_sizes`` and builds, inside each CP group, level-1 groups of
consecutive CP ranks and level-2 groups of strided ones (``create_hierarchical_groups``, with
einops) that ``get_hierarchical_context_parallel_groups()`` returns: exactly the Ulysses (inside)
and ring (across) groups the hybrid kernel needs. Building them there, rather than groups of our
own, keeps megatron's one place of group creation (every rank creates every group in one order,
as torch requires; a group cannot be made later, at the first forward, without every rank
agreeing) and covers both entry points: megatron-core users calling it themselves, and
Megatron-LM's ``initialize_megatron``, which passes ``args.hierarchical_context_parallel_sizes``.
The wrapper passes ``[N, CP/N]`` when the caller gave no sizes and refuses sizes that disagree.

Megatron-LM (``check_megatron_args``, a validate_args hook): the degree is checked against
``--context-parallel-size`` before validation, and ``args.hierarchical_context_parallel_sizes`` is
set to ``[N, CP/N]``, so what megatron validates (product == CP), logs ("hierarchical
context-parallel sizes"), passes to ``initialize_model_parallel`` and copies into the model config
all say the same. Nothing else in megatron 0.16 reads the sizes (the batch split is by CP rank
only; TE's ``a2a+p2p`` reads the groups, not the sizes).

``check_initialized``: configure() after megatron's parallel state exists (no wrapper ran): the
groups must be there with the right sizes. megatron's ``destroy_model_parallel`` does not clear
its hierarchical groups (0.13-0.19), so a stale list from an earlier initialization (its groups
destroyed, or of another CP group) counts as none (``current_groups``).

einops: megatron imports it optionally and raises a bare ImportError in the group builder; it is
a runtime dependency of mindspeed_like (pyproject.toml), and its absence is a ConfigError here.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass

from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.targets import CORE

HYBRID = "hybrid_cp_algo"
INITIALIZE_MODEL_PARALLEL = f"{CORE}.parallel_state.initialize_model_parallel"


def hierarchical_sizes(degree: int, cp_size: int) -> list[int]:
    """``[degree, cp_size // degree]``: megatron's hierarchical CP sizes for a Ulysses degree."""
    if degree < 1 or cp_size % degree:
        divisors = [d for d in range(1, cp_size + 1) if cp_size % d == 0]
        raise ConfigError(
            f"--ulysses-degree-in-cp {degree} does not divide --context-parallel-size {cp_size}: the Ulysses groups "
            f"split each context-parallel group evenly; use one of {', '.join(map(str, divisors))}"
        )
    return [degree, cp_size // degree]


def require_einops() -> None:
    if importlib.util.find_spec("einops") is None:
        raise ConfigError(
            "--context-parallel-algo hybrid_cp_algo: megatron builds its hierarchical context-parallel groups with "
            "einops, which is not installed (a mindspeed_like dependency): pip install einops"
        )


def check_sizes(degree: int, cp_size: int, given: list[int] | tuple[int, ...] | None) -> list[int]:
    """The sizes to build: derived from ``degree``; ``given`` (megatron's own flag) must agree."""
    sizes = hierarchical_sizes(degree, cp_size)
    if given and [int(s) for s in given] != sizes:
        raise ConfigError(
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, given))} disagrees with --ulysses-degree-in-cp "
            f"{degree} at --context-parallel-size {cp_size} (which means {sizes[0]} {sizes[1]}); drop "
            "--hierarchical-context-parallel-sizes, --ulysses-degree-in-cp alone builds the groups"
        )
    require_einops()
    return sizes


@dataclass(frozen=True)
class HierarchicalGroups:
    """Wrapper of ``initialize_model_parallel``: hierarchical CP sizes ``[degree, CP/degree]``."""

    degree: int

    def __call__(self, wrapped, instance, args, kwargs):
        call = Call(wrapped, args, kwargs)
        cp_size = int(call.get("context_parallel_size", 1) or 1)
        if cp_size <= 1 or "hierarchical_context_parallel_sizes" not in call:
            return wrapped(*args, **kwargs)
        sizes = check_sizes(self.degree, cp_size, call["hierarchical_context_parallel_sizes"])
        return call(hierarchical_context_parallel_sizes=sizes)


@contextlib.contextmanager
def check_megatron_args(args) -> Iterator[None]:
    """validate_args hook (Megatron-LM): a Ulysses degree that does not fit ``--context-parallel-size``
    (or disagrees with ``--hierarchical-context-parallel-sizes``) is a start-up error, before megatron
    validates and builds anything; otherwise megatron's hierarchical sizes are set from the degree."""
    degree = getattr(args, "ulysses_degree_in_cp", None)
    cp_size = int(getattr(args, "context_parallel_size", 1) or 1)
    if getattr(args, "context_parallel_algo", None) == HYBRID and cp_size > 1 and degree is not None:
        given = getattr(args, "hierarchical_context_parallel_sizes", None)
        sizes = check_sizes(degree, cp_size, given)
        if hasattr(args, "hierarchical_context_parallel_sizes"):
            args.hierarchical_context_parallel_sizes = sizes
    yield


def current_groups(parallel_state) -> list:
    """megatron's hierarchical CP groups of the current initialization: ``[]`` when there are none,
    or when the list is left from an earlier one (destroyed groups, or not inside this CP group)."""
    import torch.distributed as dist

    groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False) or []
    try:
        cp_ranks = set(parallel_state.get_context_parallel_global_ranks())
        if all(set(dist.get_process_group_ranks(g)) <= cp_ranks for g in groups):
            return list(groups)
    except (AssertionError, RuntimeError, ValueError, KeyError):  # a destroyed group is no longer registered
        pass
    return []


def check_initialized(degree: int) -> None:
    """At configure(): if megatron's parallel state already exists (initialized before the flag was
    set), its CP groups must fit ``degree`` and its hierarchical groups must have the sizes."""
    import sys

    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return
    cp_size = parallel_state.get_context_parallel_world_size()
    if cp_size <= 1:
        return
    sizes = hierarchical_sizes(degree, cp_size)
    import torch.distributed as dist

    found = [dist.get_world_size(g) for g in current_groups(parallel_state)]
    if found != sizes:
        raise ConfigError(
            f"hybrid_cp_algo with --ulysses-degree-in-cp {degree}: megatron's parallel state (CP={cp_size}) was "
            f"initialized before mindspeed_like was configured with it, with hierarchical context-parallel groups "
            f"of sizes {found or 'none'} (needed: {sizes}); configure first (the groups are then built from the "
            f"degree), or pass initialize_model_parallel(..., hierarchical_context_parallel_sizes={sizes})"
        )
