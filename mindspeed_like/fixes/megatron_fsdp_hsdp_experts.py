"""Refusal: Megatron-FSDP's hybrid sharding with expert parallelism where megatron-core builds no expert mesh for it.

With ``--use-megatron-fsdp --num-distributed-optimizer-instances N`` (HSDP) Megatron-FSDP's wrapper builds its
process groups in ``mcore_fsdp_adapter.FullyShardedDataParallel._init_dist_index``. megatron-core 0.16.1's
hybrid branch hands ``FSDPDistributedIndex`` no expert device mesh (only the non-hybrid branch builds one), so
its expert data-parallel group is None there, and a collective given ``group=None`` runs over the default
group: the whole world. At expert-parallel size > 1 the ranks of one EP group hold different experts, so the
experts' buffers would be reduced and gathered with other experts' ranks: it trains, silently wrong (measured
without this refusal, 4 gloo ranks, the tests' tiny MoE GPT at DP 4 in 2 instances x EP 2: grad norm 0.810438 at
step 1 against the distributed optimizer's 0.808926 with the same instances, loss 5.543507 at step 2 against
5.543381). megatron-core 0.17.1, 0.18.2 and
0.19.2 build the expert mesh under HSDP (``_get_hsdp_tp_mesh(outer, intra-instance expert DP, expert TP,
ep_size=...)`` and ``hybrid_fsdp_expt_group``; read in all three): on 0.19.2 the layout trains as one instance
does (tests/fsdp/test_megatron_fsdp_hsdp_experts.py).

Whether the installed release has it is read from its source (:func:`expert_mesh_under_hsdp`: does the
``FSDPDistributedIndex(...)`` call of ``_init_dist_index`` that passes ``dp_outer_dim`` also pass
``expt_device_mesh``?), not from a version table. Where it has not, the layout is refused where it is chosen:
Megatron-LM's argument validation, ``FullyShardedDataParallel``'s construction (megatron-core API users), and
``mindspeed-like plan`` / ``compare`` (``plan.fsdp.hybrid_sharding_refusal``). At EP 1 there is nothing to
refuse: the experts are replicated like every other parameter and megatron-core 0.16.1 trains that layout as
the distributed optimizer does (docs/features/fsdp.md).
"""

from __future__ import annotations

import ast
import contextlib
import functools
from collections.abc import Iterator

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.declaration import Feature
from mindspeed_like.toolkit.errors import ConfigError

NAME = "fix-megatron-fsdp-hsdp-experts"
VERSIONS = ">=0.14"
TARGET = "megatron.core.distributed.fsdp.mcore_fsdp_adapter.FullyShardedDataParallel.__init__"
ADAPTER = "distributed/fsdp/mcore_fsdp_adapter.py"
"""The adapter's file below megatron-core's package directory."""
HAS_IT = "0.17 or later"
"""The releases that build the expert mesh under HSDP (read in 0.17.1, 0.18.2 and 0.19.2; trained on 0.19.2)."""

MESSAGE = (
    "--num-distributed-optimizer-instances {instances} with --expert-model-parallel-size {ep} under "
    "--use-megatron-fsdp: megatron-core {version}'s Megatron-FSDP builds no expert mesh under hybrid sharding "
    "(mcore_fsdp_adapter.FullyShardedDataParallel._init_dist_index hands FSDPDistributedIndex no expert device "
    "mesh in its hybrid branch), so the experts' buffers would be sharded and reduced over every rank, across expert-"
    "parallel ranks that hold other experts. megatron-core {has_it} builds one (hybrid_fsdp_expt_group). Use "
    "--expert-model-parallel-size 1, one distributed-optimizer instance, or megatron-core {has_it}."
)


def _hybrid_index_calls(tree: ast.AST) -> list[ast.Call]:
    """The ``FSDPDistributedIndex(...)`` calls inside ``_init_dist_index`` that build the hybrid index (the
    ones passing ``dp_outer_dim``)."""
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_init_dist_index":
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and getattr(call.func, "id", getattr(call.func, "attr", None)) == "FSDPDistributedIndex"
                    and any(keyword.arg == "dp_outer_dim" for keyword in call.keywords)
                ):
                    calls.append(call)
    return calls


@functools.cache
def _read(path: str) -> bool | None:
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError):
        return None
    calls = _hybrid_index_calls(tree)
    if not calls:
        return None
    return all(any(keyword.arg == "expt_device_mesh" for keyword in call.keywords) for call in calls)


def expert_mesh_under_hsdp(core_dir: str | None = None) -> bool | None:
    """Whether the installed megatron-core's Megatron-FSDP builds an expert device mesh under hybrid sharding:
    read from ``mcore_fsdp_adapter.py`` without importing megatron (``core_dir``: megatron-core's package
    directory, default the one ``import megatron.core`` would load). None where the file or its hybrid
    ``FSDPDistributedIndex`` call is not found (no Megatron-FSDP in that release, or a layout not read here)."""
    from mindspeed_like.megatron_version import core_file

    path = core_file(ADAPTER, core_dir)
    return None if path is None else _read(path)


def _version() -> str:
    from mindspeed_like.megatron_version import megatron_core_version

    return str(megatron_core_version() or "(this release)")


def refusal(instances: int, ep: int, has_mesh: bool | None = None, version: str | None = None) -> str | None:
    """The refusal's message for Megatron-FSDP with ``instances`` distributed-optimizer instances at expert-
    parallel size ``ep`` on the installed megatron-core (or on ``version``, whose answer is ``has_mesh``: the
    plan predicting a record of another release), or None where it trains (for tools that check a
    configuration before any process builds a wrapper: ``mindspeed-like plan`` and ``compare``)."""
    if has_mesh is None:
        has_mesh = expert_mesh_under_hsdp() is not False
    if instances <= 1 or ep <= 1 or has_mesh:
        return None
    return MESSAGE.format(instances=instances, ep=ep, version=version or _version(), has_it=HAS_IT)


def _expert_parallel_size(pg_collection) -> int:
    ep_group = getattr(pg_collection, "ep", None) if pg_collection is not None else None
    if ep_group is not None:
        return ep_group.size()
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()


def refuse_at_construction(wrapped, instance, args, kwargs):
    call = Call(wrapped, args, kwargs)
    ddp_config = call["ddp_config"]
    instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1) or 1
    if instances > 1:
        message = refusal(instances, _expert_parallel_size(call.get("pg_collection")))
        if message:
            raise ConfigError(message)
    return wrapped(*args, **kwargs)


@contextlib.contextmanager
def refuse_on_the_command_line(args) -> Iterator[None]:
    if getattr(args, "use_megatron_fsdp", False):
        message = refusal(
            getattr(args, "num_distributed_optimizer_instances", 1) or 1,
            getattr(args, "expert_model_parallel_size", 1) or 1,
        )
        if message:
            raise ConfigError(message)
    yield


def _lacks_the_mesh(ctx) -> bool:
    return expert_mesh_under_hsdp() is False


PATCHES = [
    Patch(
        TARGET,
        Kind.WRAP,
        refuse_at_construction,
        versions=VERSIONS,
        # outermost: refused before anything is built
        after=("cpu-adapter", "megatron-fsdp-lean-state", "fix-megatron-fsdp-no-shard"),
        why="hybrid sharding at expert-parallel size > 1 has no expert mesh in this release: refused, not run",
    )
]

FEATURE = Feature(
    name=NAME,
    summary="--use-megatron-fsdp with --num-distributed-optimizer-instances > 1 at --expert-model-parallel-size > 1 "
    "is refused where megatron-core's Megatron-FSDP builds no expert mesh under hybrid sharding (0.16.1; 0.17 "
    "and later build one)",
    patches=PATCHES,
    enabled=_lacks_the_mesh,
    validate_args_hook=refuse_on_the_command_line,
    backend="any",
    kind="fix",
)
