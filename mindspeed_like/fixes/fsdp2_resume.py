"""Fix: Megatron-LM's ``--use-torch-fsdp2`` runs resume from ``--load`` exactly, in both formats.

Two gaps of Megatron-LM core_v0.16.1's ``load_checkpoint`` with a torch-FSDP2 model (whose optimizer is
megatron's non-distributed one, inside a ``ChainedOptimizer``), on every device:

* ``--ckpt-format torch_dist``: ``setup_model_and_optimizer`` passes ``skip_load_to_model_and_opt=True``
  because ``dist_checkpointing.load`` writes the parameters and the optimizer's moments into the
  DTensors' local shards in place. The Adam step is not a shard: megatron saves it as one common
  value (``state['common_step']``), which only ``optimizer.load_state_dict`` puts back, and that is
  skipped. The resumed optimizer restarts its bias correction at step 1: the iteration after the
  load equals the uninterrupted run, the next ones do not (lm loss 5.685097 vs 5.713458 at iteration
  5 of a run saved at 3; 2 gloo ranks, dropout on). Here, after such a load, each optimizer's step
  is set from the loaded common value, as ``_restore_common_per_param_step`` does in a full load.
* ``--ckpt-format torch_dcp``: ``load_checkpoint`` asks ``optimizer.state_dict(is_loading=True)``
  (the states to load into must exist first), which ``Float16OptimizerWithFloat16Params`` takes but
  ``ChainedOptimizer`` and ``FP32Optimizer`` do not: ``TypeError: ChainedOptimizer.state_dict() got
  an unexpected keyword argument 'is_loading'`` at every ``--load``. Here both take it, as the
  Float16 optimizer does: the chain hands it to each optimizer, the FP32 optimizer creates its
  states (``init_state_fn``) before returning them.
"""

from __future__ import annotations

import contextvars
import copy
import inspect
from typing import Any

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-fsdp2-resume"
CHECKPOINTING = "megatron.training.checkpointing"
OPTIMIZER = "megatron.core.optimizer.optimizer"

_loaded: contextvars.ContextVar[list | None] = contextvars.ContextVar("fsdp2_loaded_state", default=None)


def _keep_loaded_state(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    holder = _loaded.get()
    if holder is not None and isinstance(result, tuple) and result and isinstance(result[0], dict):
        holder.append(result[0])
    return result


def _common_step(state_dict: Any) -> Any:
    if not isinstance(state_dict, dict):
        return None
    inner = state_dict.get("optimizer", state_dict)  # the Float16 optimizer nests torch's under 'optimizer'
    state = inner.get("state") if isinstance(inner, dict) else None
    return state.get("common_step") if isinstance(state, dict) else None


def restore_steps(optimizer: Any, optimizer_state: Any) -> int:
    """Each optimizer's per-parameter step from the loaded common step; returns how many were set."""
    chained = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    if len(chained) == 1:
        states = [optimizer_state]
    elif isinstance(optimizer_state, dict):
        states = [value for _, value in sorted(optimizer_state.items())]
    else:
        states = list(optimizer_state or [])
    restored = 0
    for member, state in zip(chained, states):
        step = _common_step(state)
        torch_optimizer = getattr(member, "optimizer", None)
        if step is None or torch_optimizer is None:
            continue
        for param_state in torch_optimizer.state.values():
            # every state, as megatron's _restore_common_per_param_step: under --bf16 the Float16
            # optimizer's load-time init_state_fn writes FusedAdam's layout (moments, no 'step'),
            # and a state skipped here took torch's step 0 at the next step()
            if param_state:
                param_state["step"] = copy.deepcopy(step)
                restored += 1
    return restored


def _load_with_steps(wrapped, instance, args, kwargs):
    call = Call(wrapped, args, kwargs)
    optimizer = call.get("optimizer")
    if (
        not call.get("skip_load_to_model_and_opt")
        or optimizer is None
        or getattr(optimizer, "is_stub_optimizer", False)
    ):
        return wrapped(*args, **kwargs)
    holder: list = []
    token = _loaded.set(holder)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _loaded.reset(token)
    loaded = holder[-1] if holder else None
    if isinstance(loaded, dict) and "optimizer" in loaded:
        restore_steps(optimizer, loaded["optimizer"])
    return result


def _takes_is_loading(function) -> bool:
    return "is_loading" in inspect.signature(function).parameters


def _fp32_state_dict(wrapped, instance, args, kwargs):
    if "is_loading" in kwargs and not _takes_is_loading(wrapped):
        kwargs = dict(kwargs)
        if kwargs.pop("is_loading"):
            instance.init_state_fn(instance.optimizer, instance.config)
    return wrapped(*args, **kwargs)


def _chained_state_dict(wrapped, instance, args, kwargs):
    if "is_loading" not in kwargs or _takes_is_loading(wrapped):
        return wrapped(*args, **kwargs)
    is_loading = kwargs.pop("is_loading")
    states = [member.state_dict(is_loading=is_loading) for member in instance.chained_optimizers]
    return states[0] if len(states) == 1 else states


PATCHES = [
    Patch(
        f"{CHECKPOINTING}._load_base_checkpoint",
        Kind.WRAP,
        _keep_loaded_state,
        optional=True,  # megatron.training: a Megatron-LM checkout (in the wheel from 0.17)
        module=CHECKPOINTING,
        why="the loaded state dict, for load_checkpoint's FSDP2 step restore below",
    ),
    Patch(
        f"{CHECKPOINTING}.load_checkpoint",
        Kind.WRAP,
        _load_with_steps,
        optional=True,
        module=CHECKPOINTING,
        why="--use-torch-fsdp2 with torch_dist skips optimizer.load_state_dict, which alone restores Adam's step",
    ),
    Patch(
        f"{OPTIMIZER}.FP32Optimizer.state_dict",
        Kind.WRAP,
        _fp32_state_dict,
        why="torch_dcp's load asks state_dict(is_loading=True), which only the Float16 optimizer takes",
    ),
    Patch(
        f"{OPTIMIZER}.ChainedOptimizer.state_dict",
        Kind.WRAP,
        _chained_state_dict,
        why="torch_dcp's load asks state_dict(is_loading=True), which only the Float16 optimizer takes",
    ),
]

FEATURE = Feature(
    name=NAME,
    summary="Megatron-LM's --use-torch-fsdp2 resumes exactly: Adam's step restored after torch_dist's in-place "
    "load (was restarted at 1), torch_dcp's --load builds (was TypeError: state_dict(is_loading=))",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
