"""fsdp2-config (``--fsdp2-config-path FILE.yaml``, MindSpeed's spelling): MindSpeed's FSDP2 YAML on
megatron's torch-FSDP2 path (``--use-torch-fsdp2``): HSDP (``sharding_size``), the FSDP units, ignored
and recomputed modules as MindSpeed's dotted patterns, ``reshard_after_forward``, mixed precision,
CPU offload and explicit prefetch, mapped onto torch's ``fully_shard``.

Checked early: the file's keys, types, dtypes and patterns when the config is resolved (``configure()``
and every command line), the Megatron-LM arguments and ``sharding_size`` against the data-parallel size
in ``validate_args``; whether each pattern matches a module when megatron's wrapper is built, before
any forward. Each error names the key (``options.py``). The mechanism: ``sharding.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.fsdp2_config import options as yaml_options
from mindspeed_like.features.fsdp2_config.sharding import ShardWithConfig, shard_as_planned, shard_group_of_hsdp
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.targets import CORE

NAME = "fsdp2-config"
MODULE = f"{CORE}.distributed.torch_fully_sharded_data_parallel"


def patches(ctx: Context) -> list[Patch]:
    # the file is read when megatron's wrapper is built (validate() has checked it by then): building
    # the patch list reads nothing (the CLI and the version audit build it without a file)
    return [
        Patch(
            f"{MODULE}.TorchFullyShardedDataParallel.__init__",
            Kind.WRAP,
            ShardWithConfig(ctx["fsdp2_config_path"], ctx.device),
            # above the cpu adapter's host twin (megatron's body on a host), below the te-backend's
            # unit filter (its filtered entries are the "megatron's choice" we keep)
            after=("cpu-adapter",),
            before=("te-backend",),
            why="the YAML's units, mesh, ignored and recomputed modules resolved against the model before "
            "megatron's fully_shard walk (sharding.py)",
        ),
        Patch(
            f"{MODULE}.fully_shard",
            Kind.WRAP,
            shard_as_planned,
            update_aliases=False,  # megatron's FSDP2 wrapper's own name for torch's fully_shard only
            why="inside that __init__ only: fully_shard gets the YAML's mesh, mixed precision, offload, "
            "reshard_after_forward and ignored parameters; YAML units sharded bottom-up",
        ),
        Patch(
            f"{CORE}.utils.get_data_parallel_group_if_dtensor",
            Kind.WRAP,
            shard_group_of_hsdp,
            why="grad norms of HSDP's (Replicate, Shard) gradients reduce over the shard group; megatron asks a "
            "2-D mesh for one group and torch refuses",
        ),
    ]


def validate(ctx: Context) -> None:
    """The file itself, at configure() and every command line (the model is not needed)."""
    options = yaml_options.load(ctx["fsdp2_config_path"])
    if options.offload_to_cpu and ctx.device == "cpu":
        raise options.error(
            "offload_to_cpu", "the parameters already live in host memory on a CPU device: nothing to offload"
        )


@contextlib.contextmanager
def check_arguments(args) -> Iterator[None]:
    """validate_args hook: what the YAML asks against Megatron-LM's arguments."""
    path = getattr(args, "fsdp2_config_path", None)
    if not path:
        yield
        return
    options = yaml_options.load(path)
    if not getattr(args, "use_torch_fsdp2", False):
        raise ConfigError(
            f"--fsdp2-config-path {path} configures megatron's torch FSDP2 path: add --use-torch-fsdp2 "
            "(with --untie-embeddings-and-output-weights and --ckpt-format torch_dist or torch_dcp)"
        )
    if options.recompute_modules and getattr(args, "recompute_granularity", None):
        raise options.error(
            "recompute_modules",
            f"megatron's --recompute-granularity {args.recompute_granularity} recomputes layers too; a layer would "
            "be recomputed twice. Use one of the two",
        )
    if (
        "reshard_after_forward" in options.given
        and options.reshard_after_forward is not False
        and (getattr(args, "torch_fsdp2_reshard_after_forward", True) is False)
    ):
        raise options.error(
            "reshard_after_forward",
            f"{options.reshard_after_forward!r} contradicts --torch-fsdp2-no-reshard-after-forward; keep one",
        )
    yield
    size = args.data_parallel_size * getattr(args, "context_parallel_size", 1)
    options.check_group_size(size, "the data-parallel size x context-parallel size")


FEATURE = Feature(
    name=NAME,
    summary="MindSpeed's FSDP2 YAML (--fsdp2-config-path) on megatron's --use-torch-fsdp2: HSDP, units and ignored/"
    "recomputed modules by pattern, reshard_after_forward, mixed precision, offload, prefetch",
    patches=patches,
    flags=(
        Flag(
            "fsdp2_config_path",
            str,
            None,
            "MindSpeed's FSDP2 YAML for --use-torch-fsdp2 (keys: docs/features/fsdp2-config.md): sharding_size (HSDP), "
            "sub_modules_to_wrap / ignored_modules / recompute_modules as dotted patterns, reshard_after_forward, "
            "param/reduce/output dtype, offload, prefetch",
        ),
    ),
    enabled=lambda ctx: bool(ctx["fsdp2_config_path"]),
    validate=validate,
    validate_args_hook=check_arguments,
    backend="any",
    switched_by="--fsdp2-config-path FILE.yaml",
    built_at_construction="its FSDP units, mesh and recomputed forwards (set when megatron's FSDP2 wrapper is built)",
)

__all__ = ["FEATURE", "NAME"]
