"""megatron's torch-FSDP2 wrapper shards the units it shards under TransformerEngine.

``TorchFullyShardedDataParallel`` (``--use-torch-fsdp2``) calls ``fully_shard`` on every submodule
that is an instance of a class in ``sub_modules_to_wrap`` (default: ``TransformerLayer``,
``LanguageModelEmbedding``, ``RotaryEmbedding``, ``tensor_parallel.ColumnParallelLinear``), walking
``module.modules()`` parents first. ``ColumnParallelLinear`` is there for the GPT output layer: with
TransformerEngine the linears inside a layer are TE's classes, not ``ColumnParallelLinear``, so only
the output layer matches (with the local spec megatron drops the entry, whose layers' linears are
``ColumnParallelLinear``). The te-backend's TE classes are built on megatron's parallel layers and
so ARE ``ColumnParallelLinear`` instances: each linear inside an already-sharded layer was sharded
again, parent first, and torch failed in ``_init_sharding_spec_tp`` ("Invariant encountered: value
was None"). Here the entry matches what it matches under TE: megatron's parallel linears that are
not te-backend layers. A user's own ``sub_modules_to_wrap`` gets the same reading.
"""

from __future__ import annotations

from typing import Any

from mindspeed_like.toolkit.binding import Call

TARGET = "megatron.core.distributed.torch_fully_sharded_data_parallel.TorchFullyShardedDataParallel.__init__"


def _te_backend_layers() -> tuple[type, ...]:
    from mindspeed_like.te_backend import classes

    return tuple(getattr(classes, name) for name in classes.__all__)


class _NotTEBackend(type):
    """isinstance: an instance of ``base`` that is not one of the te-backend's TE layers."""

    base: type

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, cls.base) and not isinstance(instance, _te_backend_layers())

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, cls.base) and not issubclass(subclass, _te_backend_layers())


_as_under_te: dict[type, type] = {}


def as_under_te(entry: Any) -> Any:
    """``entry`` of ``sub_modules_to_wrap`` as it matches with TransformerEngine installed: a class
    the te-backend's layers derive from matches megatron's own instances of it only."""
    if not isinstance(entry, type) or not any(issubclass(layer, entry) for layer in _te_backend_layers()):
        return entry
    if entry not in _as_under_te:
        _as_under_te[entry] = _NotTEBackend(f"{entry.__name__}NotTEBackend", (), {"base": entry})
    return _as_under_te[entry]


def shard_as_under_te(wrapped, instance, args, kwargs):
    call = Call(wrapped, args, kwargs)
    config = call["config"]
    modules = call.get("sub_modules_to_wrap")
    if getattr(config, "transformer_impl", None) == "local" or not modules:
        return wrapped(*args, **kwargs)
    # megatron's own local-spec filter compares entries with `!=`: only non-local configs get here
    return call(sub_modules_to_wrap={as_under_te(entry) for entry in modules})
