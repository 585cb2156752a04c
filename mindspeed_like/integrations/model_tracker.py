"""Records each megatron TransformerBlock built, so that switching a construction-time feature
after a model exists is logged (see ``toolkit.built_models``). ``TransformerBlock.__init__`` is
the target because every megatron-core language model builds exactly one per pipeline stage."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit import built_models
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import CORE


def _record_block(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    built_models.record(instance)
    return result


FEATURE = Feature(
    name="model-construction-tracker",
    summary="knows which megatron models exist, so construction-time features switched later are reported",
    patches=[
        Patch(
            f"{CORE}.transformer.transformer_block.TransformerBlock.__init__",
            Kind.WRAP,
            _record_block,
            why="every megatron-core language model builds one TransformerBlock per pipeline stage",
        )
    ],
    enabled=always_on,
    backend="any",
    kind="integration",
)
