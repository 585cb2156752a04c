"""Fix: megatron's torch-FSDP2 wrapper shards the local spec's linears twice.

``TorchFullyShardedDataParallel.__init__`` (``--use-torch-fsdp2``) calls ``fully_shard`` on every
submodule that is an instance of an entry of ``sub_modules_to_wrap`` (default ``TransformerLayer``,
``LanguageModelEmbedding``, ``RotaryEmbedding``, ``ColumnParallelLinear``), parents first. With the local
spec a layer's linears ARE ``ColumnParallelLinear``: each was sharded again inside its already-sharded
layer and torch stopped in ``_init_sharding_spec_tp`` ("Invariant encountered: value was None when it
should not be"), on every device, before the first step. megatron-core 0.14 drops the entry when
``config.transformer_impl == "local"``; 0.13's config has no ``transformer_impl``, so the fix reads the
spec from the model: a ``TransformerLayer`` holding megatron's own ``ColumnParallelLinear`` (not a
te-backend TE layer, which ``te_backend/fsdp2.py`` handles) is the local spec, and the entry goes as
0.14 drops it. Measured on 0.13.1 (tests/fsdp/test_fsdp2_config.py::test_local_spec_keeps_megatrons_units
and the FSDP2 local-spec runs): the error without the fix, the 0.14+ units and DDP's losses with it.

0.14 and later still stop so on the megatron-core API path: ``TransformerConfig.transformer_impl`` defaults to
``"transformer_engine"``, and a script that builds ``get_gpt_layer_local_spec()`` without also setting
``transformer_impl="local"`` (megatron's own examples do not set it; Megatron-LM's ``--transformer-impl local``
does) keeps the entry (megatron-core 0.16.1, 2 gloo ranks, tiny GPT: "Invariant encountered" in ``get_model``'s
place, before the first step, on every device). So the fix reads the model on every release: with the entry
dropped that script trains as the same model with ``transformer_impl="local"`` to the printed digit (lm loss
5.570875 / 5.560352 / 5.565810, as DDP).
"""

from __future__ import annotations

from typing import Any

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.te_backend.fsdp2 import TARGET, as_under_te
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-fsdp2-local-spec-units"
VERSIONS = None
"""Every release: 0.13.1 read (no ``transformer_impl`` in its TransformerConfig); 0.14.0-0.19.2 read (megatron's own
filter, on ``config.transformer_impl`` only)."""


def _local_spec(module: Any) -> bool:
    """A TransformerLayer of ``module`` holds megatron's own ColumnParallelLinear (te-backend layers aside)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer

    megatrons_own = as_under_te(ColumnParallelLinear)
    return any(
        isinstance(inner, megatrons_own)
        for layer in module.modules()
        if isinstance(layer, TransformerLayer)
        for inner in layer.modules()
    )


def drop_column_parallel_for_the_local_spec(wrapped, instance, args, kwargs):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    call = Call(wrapped, args, kwargs)
    modules = call.get("sub_modules_to_wrap")
    if not modules or ColumnParallelLinear not in set(modules) or not _local_spec(call["module"]):
        return wrapped(*args, **kwargs)
    return call(sub_modules_to_wrap={entry for entry in modules if entry is not ColumnParallelLinear})


PATCHES = [
    Patch(
        TARGET,
        Kind.WRAP,
        drop_column_parallel_for_the_local_spec,
        versions=VERSIONS,
        # outermost: the te-backend's and the YAML's unit choices then see the entries 0.14 would hand them
        after=("cpu-adapter", "fsdp2-config", "te-backend"),
        why="the local spec's ColumnParallelLinear is sharded inside its sharded layer (torch: Invariant "
        "encountered) on 0.13, and on 0.14+ where config.transformer_impl is not 'local' (its default)",
    )
]

FEATURE = Feature(
    name=NAME,
    summary="--use-torch-fsdp2 on the local spec (megatron-core 0.13; 0.14+ with config.transformer_impl left at its "
    "default): ColumnParallelLinear not sharded inside its sharded layer (was torch's 'Invariant encountered' before "
    "the first step), as 0.14+ does for transformer_impl='local'",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
