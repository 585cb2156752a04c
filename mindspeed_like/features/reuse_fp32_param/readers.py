"""Megatron-side readers of the fp32 masters outside the optimizer step read the true values.

Between steps the feature keeps each master as its bf16 weight plus an int16 residual, so what
``param.main_param`` holds there is not a master: with the Float16 optimizer it is the shared
buffer read as fp32 (bf16 and residual halves interleaved: ``params norm: nan`` in one process),
with the DistributedOptimizer a zero-stride placeholder (``params norm: 0.000`` at DP=2). Issue 37
item 4 found Megatron-LM's ``--log-params-norm`` printing those while megatron's path printed
18.763.

Targets (WRAP, optional: Megatron-LM's training loop only; each waits for its module's import):

* ``megatron.training.utils.calc_params_l2_norm`` (``--log-params-norm``; from 0.18 in
  ``megatron.training.utils.common_utils``): reads ``param.main_param`` of every bf16 parameter
  (sharded or not), the only megatron reader of masters outside the optimizer's own methods (those
  are the feature's ``MASTER_READERS``). Around the call every optimizer the feature set up holds
  true fp32 masters: the Float16 buffers in their fp32 layout (in place, no memory), the
  DistributedOptimizer's shards materialized (megatron's own 4 B/param/DP for the call); each goes
  back to the split layout afterwards, so the step after it is unchanged (bitwise).

Not readers of masters: ``--log-num-zeros-in-grad`` counts the masters' gradients (megatron
assigns them every step; equal to megatron's path in tests/reliability/test_megatron_lm_params_norm.py),
``--check-weight-hash-across-dp-replicas-interval`` hashes the bf16 model parameters (true in the
split layout); checkpoints hold plain fp32 masters (the optimizer wrappers of ``wrappers.py``).
A writer not covered: megatron's QK-clip (``Attention.clip_qk``, MLA's) copies clipped values into
``main_param.data`` after the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.reuse_fp32_param import live
from mindspeed_like.features.reuse_fp32_param.float16 import ReuseFp32ParamUnsupported, ReuseState, state_of
from mindspeed_like.toolkit.declaration import Context
from mindspeed_like.toolkit.targets import TRAINING_UTILS

PARAMS_NORM = {  # module holding Megatron-LM's calc_params_l2_norm -> its versions
    TRAINING_UTILS: "<0.18",
    f"{TRAINING_UTILS}.common_utils": ">=0.18",  # megatron.training.utils became a package
}


@contextlib.contextmanager
def true_masters() -> Iterator[None]:
    """Every live optimizer of the feature holds exact fp32 masters inside; split layouts after."""
    changed = []
    try:
        with torch.no_grad():
            for optimizer in live.live_optimizers(collect=False):
                state = state_of(optimizer)
                if state is None or state.layout != "split":
                    continue  # already true fp32 masters (inside a step, or materialized for a checkpoint)
                changed.append(state)
                if isinstance(state, ReuseState):
                    state.to_fp32()
                else:
                    state.materialize()
        yield
    finally:
        with torch.no_grad():
            for state in changed:
                state.to_split()


def reads_true_masters(wrapped, instance, args, kwargs):
    """wrapt wrapper: ``wrapped`` runs while the masters are true fp32 values."""
    with true_masters():
        return wrapped(*args, **kwargs)


def patches(ctx: Context) -> list[Patch]:
    missing = ctx.fallback(
        "reuse-fp32-param", ReuseFp32ParamUnsupported, "--log-params-norm reads bf16 + residual as masters"
    )
    return [
        Patch(
            f"{module}.calc_params_l2_norm",
            Kind.WRAP,
            reads_true_masters,
            optional=True,
            module=module,
            versions=versions,
            on_missing=missing,
            why="--log-params-norm reads param.main_param: true fp32 masters around the call",
        )
        for module, versions in PARAMS_NORM.items()
    ]
