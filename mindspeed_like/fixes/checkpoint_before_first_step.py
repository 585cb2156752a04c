"""Fix: a checkpoint saved before the optimizer's first step cannot be loaded (every megatron-core
release we support, and megatron's main branch as of this writing).

torch's Adam creates a parameter's state (``exp_avg``, ``exp_avg_sq``, ``step``) lazily, at that
parameter's first step. Until then ``optimizer.state`` is empty, and megatron saves what it finds:
``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer.sharded_state_dict`` (and the
DistributedOptimizer's bucket and model-space formats) write no moments. The load builds the
state it wants to read from a state it INITIALISES first (``init_state_fn`` when ``is_loading``:
zero moments for every parameter), so it asks the checkpoint for moments that were never written:
``KeyError: "optimizer.state.exp_avg.decoder.layers.self_attention.linear_proj.weight from model not
in state dict"`` (Float16 optimizer), ``"...bucket_idx_0.exp_avg from model not in state dict"``
(DistributedOptimizer). The common way to get there is fp16 with megatron's default
``--initial-loss-scale`` (2**32): the grad scaler skips every step until the scale has come down
(a tiny model: more than 20), so an early ``--save`` holds an optimizer that has not stepped
(reproduced through Megatron-LM core_v0.16.1 pretrain_gpt.py: ``--fp16 --train-iters 4
--save-interval 2 --exit-interval 2``, then ``--load``); it happens with any step-free save
(``--save-interval`` before the first step, ``--skip-train`` style tools that save at once).

Here a checkpoint always holds the state the load asks for: when megatron builds the state dict
to SAVE and a parameter has no optimizer state yet, the state is made for the call with megatron's
own ``init_state_fn`` (the function its load runs), plus the ``step`` torch's Adam/AdamW would
create at the first step (0; megatron's Float16/FP32 optimizers save the common step only when it
is non-zero, ``if step:``, so a zero step is written here too: without it the loaded moments come
back without a ``step`` and torch's Adam stops with ``KeyError: 'step'``), and removed again after
the call: the running optimizer is left as it was (its first step initialises its state as
before), and a load gets exactly that first step's state (zero moments, step 0), so the resumed
run goes on as the uninterrupted one. A plain megatron (without this library) loads such a
checkpoint too. Only an optimizer with NO state at all is touched: a partly initialised one is
megatron's ordinary case.

Targets: ``sharded_state_dict`` of the three optimizer classes that build a checkpoint's
optimizer state (a ChainedOptimizer calls its members'); the non-sharded ``state_dict`` (``--ckpt-format
torch``) is not affected (its load reads the empty state back as it was saved).
"""

from __future__ import annotations

from typing import Any

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.fixes.adam_state_without_step import add_missing_steps
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import DISTRIB_OPTIMIZER, OPTIMIZER

FLOAT16 = f"{OPTIMIZER}.Float16OptimizerWithFloat16Params"
FP32 = f"{OPTIMIZER}.FP32Optimizer"
DISTOPT = f"{DISTRIB_OPTIMIZER}.DistributedOptimizer"
REUSE = "reuse-fp32-param"  # its "materialize the masters first" sits above megatron's DistributedOptimizer method


def _inner_params(inner: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in inner.param_groups for param in group["params"]]


def initialise_unstepped(optimizer: Any) -> list[torch.Tensor]:
    """If megatron's ``optimizer`` has not stepped (its inner optimizer holds no state), give every
    parameter the state its load initialises (``init_state_fn``) and, for torch's Adam/AdamW, the
    first step's ``step``; returns the parameters given a state (empty: nothing was done)."""
    inner = getattr(optimizer, "optimizer", None)
    init = getattr(optimizer, "init_state_fn", None)
    if not isinstance(inner, torch.optim.Optimizer) or init is None or len(inner.state) != 0:
        return []
    params = _inner_params(inner)
    init(inner, getattr(optimizer, "config", None))
    add_missing_steps(inner)
    return [param for param in params if param in inner.state]


def _forget(optimizer: Any, params: list[torch.Tensor]) -> None:
    for param in params:
        optimizer.optimizer.state.pop(param, None)


def _is_loading(model_sharded_state_dict: Any = None, is_loading: bool = False, *args: Any, **kwargs: Any) -> bool:
    """megatron's signature: ``sharded_state_dict(self, model_sharded_state_dict, is_loading=False, ...)``."""
    return is_loading


def _saved_with_state(wrapped, instance, args, kwargs):
    if _is_loading(*args, **kwargs):
        return wrapped(*args, **kwargs)
    made = initialise_unstepped(instance)
    try:
        result = wrapped(*args, **kwargs)
        if made and isinstance(instance.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            _keep_zero_step(instance, result, made)
        return result
    finally:
        _forget(instance, made)


def _keep_zero_step(instance: Any, result: dict, made: list[torch.Tensor]) -> None:
    """Float16 / FP32 optimizers save the common step under ``state['common_step']`` only when it
    is truthy; the first step's 0 is written too (the DistributedOptimizer keeps it in its groups)."""
    state = result.get("optimizer", result).get("state") if isinstance(result, dict) else None
    if isinstance(state, dict) and "common_step" not in state:
        state["common_step"] = instance.optimizer.state[made[0]]["step"].clone()


PATCHES = [
    Patch(
        f"{FLOAT16}.sharded_state_dict",
        Kind.WRAP,
        _saved_with_state,
        why="a save before the first step writes the moments (and step 0) its load asks for",
    ),
    Patch(
        f"{FP32}.sharded_state_dict",
        Kind.WRAP,
        _saved_with_state,
        why="a save before the first step writes the moments (and step 0) its load asks for",
    ),
    Patch(
        f"{DISTOPT}.sharded_state_dict",
        Kind.WRAP,
        _saved_with_state,
        before=(REUSE,),
        why="a save before the first step writes the moments its load asks for",
    ),
]

FEATURE = Feature(
    name="fix-checkpoint-before-first-step",
    summary="a checkpoint saved before the optimizer's first step (fp16's default initial loss scale skips "
    "the first steps) holds the moments its load asks for, so it always loads",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
