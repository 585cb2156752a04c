"""Fix: ``CheckpointWithoutOutput()`` dies without TransformerEngine.

``CheckpointWithoutOutput.__init__`` sets ``self.fp8 = fp8 is not None``, which is True for
the default ``fp8=False``, so every output-discarding recompute (recompute_modules
``layernorm``, ``moe_act``, ``mla_up_proj``) takes the TransformerEngine FP8 path and fails
with ``NameError: FP8GlobalStateManager`` when TE is not installed (megatron-core 0.13-0.20).
Upstream keeps the behaviour on purpose for TE's FP8 bookkeeping, so we only correct it
where TE is absent and that path cannot work: the flag then becomes False.

Why ``__init__`` is the target: the flag is read by ``CheckpointWithoutOutputFunction``
from the object, so fixing it where it is set covers every caller (they all construct
it through ``tensor_parallel.CheckpointWithoutOutput``, the same class object).
"""

from __future__ import annotations

import sys

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import TP_RANDOM as RANDOM_MODULE


def _init_without_te_fp8(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    if not getattr(sys.modules[RANDOM_MODULE], "HAVE_TE", False):
        instance.fp8 = False


PATCHES = [
    Patch(
        f"{RANDOM_MODULE}.CheckpointWithoutOutput.__init__",
        Kind.WRAP,
        _init_without_te_fp8,
        why="fp8 defaults to True without TransformerEngine (NameError: FP8GlobalStateManager)",
    )
]


FEATURE = Feature(
    name="fix-checkpoint-without-output-fp8",
    summary="CheckpointWithoutOutput works without TransformerEngine (upstream default-argument bug)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
