"""Refusal: Megatron-FSDP's ``no_shard`` strategy does not train correctly in megatron-core 0.14-0.18.

With ``--use-megatron-fsdp --data-parallel-sharding-strategy no_shard`` megatron-core 0.16.1 stops
after the first optimizer step: ``MegatronFSDP.start_param_sync`` all-gathers each bucket's weight
buffer before checking it exists (``AttributeError: 'NoneType' object has no attribute
'fetch_bucket'``), on every device. Returning early there (megatron-core 0.19's own code) is not
enough: the run then goes on with other numbers than DDP's, measured on 2 gloo ranks (the tiny GPT of
tests/fsdp, losses 5.560034 / 5.553199 / 5.562935 against DDP's and every other strategy's 5.560034 /
5.570179 / 5.559474; Megatron-LM's pretrain_gpt.py logs grad norm 2.283 at iteration 1 against 1.245),
because 0.16.1's gradient path for unsharded buffers differs from 0.19's, which reworked it
(``GradReducePipeline``: the all-reduced gradient copied back into the main gradient buffer). On
megatron-core 0.19.2 the same runs equal DDP to the bit, with nothing of ours involved.

So a silent wrong result becomes a clear error where the choice is made: Megatron-LM's argument
validation, and ``FullyShardedDataParallel``'s construction for megatron-core API users. 0.17 and
0.18 were not measured and are refused with 0.16: the releases before the rework.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.declaration import Feature
from mindspeed_like.toolkit.errors import ConfigError

NAME = "fix-megatron-fsdp-no-shard"
VERSIONS = ">=0.14,<0.19"
TARGET = "megatron.core.distributed.fsdp.mcore_fsdp_adapter.FullyShardedDataParallel.__init__"
MESSAGE = (
    "Megatron-FSDP's data_parallel_sharding_strategy 'no_shard' does not train correctly in megatron-core "
    "{version} (it stops after the first step, and past that its gradients differ from DDP's; megatron-core 0.19 "
    "reworked it). Use --data-parallel-sharding-strategy optim (the same memory for weights and gradients, the "
    "optimizer state sharded), plain DDP without --use-megatron-fsdp, or megatron-core 0.19."
)


def _version() -> str:
    from mindspeed_like.megatron_version import megatron_core_version

    return str(megatron_core_version() or "this release")


def refusal() -> str | None:
    """The refusal's message where the installed megatron-core is one it applies to, else None (for
    tools that check a configuration before any process builds a wrapper: ``mindspeed-like compare``)."""
    from mindspeed_like.megatron_version import megatron_core_version, release_in

    if not release_in(VERSIONS, megatron_core_version()):
        return None
    return MESSAGE.format(version=_version())


def refuse_at_construction(wrapped, instance, args, kwargs):
    ddp_config = Call(wrapped, args, kwargs)["ddp_config"]
    if getattr(ddp_config, "data_parallel_sharding_strategy", None) == "no_shard":
        raise ConfigError(MESSAGE.format(version=_version()))
    return wrapped(*args, **kwargs)


@contextlib.contextmanager
def refuse_on_the_command_line(args) -> Iterator[None]:
    if (
        getattr(args, "use_megatron_fsdp", False)
        and getattr(args, "data_parallel_sharding_strategy", None) == "no_shard"
    ):
        raise ConfigError("--data-parallel-sharding-strategy no_shard: " + MESSAGE.format(version=_version()))
    yield


PATCHES = [
    Patch(
        TARGET,
        Kind.WRAP,
        refuse_at_construction,
        versions=VERSIONS,
        after=("cpu-adapter",),  # outermost: refused before anything is built
        why="no_shard trains differently from DDP before megatron-core 0.19: refused, not run",
    )
]

FEATURE = Feature(
    name=NAME,
    summary="--use-megatron-fsdp with no_shard is refused on megatron-core 0.14-0.18 (it stops after one step and "
    "trains differently from DDP there; 0.19 reworked it)",
    patches=PATCHES,
    enabled=lambda ctx: ctx.megatron_version is None or ctx.megatron_version.release < (0, 19),
    validate_args_hook=refuse_on_the_command_line,
    backend="any",
    kind="fix",
)
