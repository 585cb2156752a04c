"""Fix: a precision-aware DistributedOptimizer checkpoint in Megatron-LM's default format cannot be loaded
(megatron-core < 0.17).

megatron's bucket-space formats (``dp_reshardable``, Megatron-LM's default for ``--ckpt-format
torch_dist`` from 0.15; ``fully_sharded_bucket_space`` before) describe each parameter's range of
a bucket as a dict of its state tensors plus a ``padding`` flag (True for the gaps between
parameters, False for a parameter), a ``LocalNonpersistentObject`` that comes back from the load
as a plain bool. ``load_parameter_state_from_dp_reshardable`` drops the padding entries and hands
each parameter's dict, flag included, to ``_set_main_param_and_optimizer_states``. With the
precision-aware optimizer (``use_precision_aware_optimizer_no_fp8_or_ds_fp8``) that method calls
``self.optimizer.set_scaled_state(param, key, value)`` for EVERY key, so the flag reaches the
optimizer as a state named ``"padding"`` with the value False: our Adam raised ``KeyError:
'padding'`` and TransformerEngine's ``FusedAdam.set_scaled_state`` (which asserts
``unscaled_state.dtype == torch.float32``) an ``AttributeError`` on the bool; either way the
checkpoint saves and the resume dies (measured on 0.16.1 through Megatron-LM's pretrain_gpt.py,
DP=2, bf16 moments and main grads). The other branch of the method (megatron's own fp32 masters)
copies only the keys of the optimizer's state and never sees the flag.

megatron fixed it in 0.17 (commit 23dd639, "skip non-tensor optimizer state entries in
distrib_optimizer"): the precision-aware branch skips entries that are not tensors. Here the same
rule runs before megatron's method on the releases without it: only tensors reach the optimizer.
Why ``_set_main_param_and_optimizer_states`` is the target: it is the one place every load path
(legacy, DP-zero, bucket space, model space, fully reshardable) hands loaded values to the
optimizer, and the one megatron itself fixed.
"""

from __future__ import annotations

from typing import Any

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import DISTRIB_OPTIMIZER

DISTOPT = f"{DISTRIB_OPTIMIZER}.DistributedOptimizer"
VERSIONS = "<0.17"  # 0.17 skips non-tensor entries itself (commit 23dd639)
# stacking: right above megatron's body, below the other wrappers of this method
APEX_FIX = "fix-distopt-checkpoint-without-apex"
REUSE = "reuse-fp32-param"


def only_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """The entries of a loaded parameter's dict that are optimizer state (tensors), not flags."""
    return {key: value for key, value in tensors.items() if isinstance(value, torch.Tensor)}


def _set_states_without_flags(wrapped, instance, args, kwargs):
    model_param, tensors = _bind(*args, **kwargs)
    if getattr(instance.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        tensors = only_tensors(tensors)
    return wrapped(model_param, tensors)


def _bind(model_param: torch.nn.Parameter, tensors: dict[str, Any]) -> tuple:
    """megatron's signature: ``_set_main_param_and_optimizer_states(self, model_param, tensors)``."""
    return model_param, tensors


PATCHES = [
    Patch(
        f"{DISTOPT}._set_main_param_and_optimizer_states",
        Kind.WRAP,
        _set_states_without_flags,
        versions=VERSIONS,
        before=(APEX_FIX, REUSE),
        why="the bucket formats' `padding` flag is not optimizer state (set_scaled_state('padding', False))",
    )
]

FEATURE = Feature(
    name="fix-distopt-padding-flag",
    summary="precision-aware DistributedOptimizer checkpoints in the bucket formats (Megatron-LM's default "
    "torch_dist) load: the `padding` flag no longer reaches the optimizer as a state",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
