"""Fix: torch's Adam behind megatron cannot hold, save, load or step an Adam state in FusedAdam's layout.

TE's and apex's FusedAdam (megatron's optimizer wherever TE or apex is installed, so on every
NVIDIA cluster) keep a parameter's state as ``exp_avg`` / ``exp_avg_sq`` only and the step count in
the param group (``group['step']``). Without them megatron drives torch's Adam/AdamW, which keep a
``step`` in every non-empty per-parameter state and read it unconditionally: ``step()``
(``_init_group``), ``load_state_dict`` (``Adam.__setstate__``) and the DistributedOptimizer's
``state_dict`` (``s["step"].item()``) all stopped with ``KeyError: 'step'`` on such a state.

Such states reach torch's Adam three ways:
- a checkpoint written by megatron with FusedAdam through the Float16 / FP32 optimizer (and so each
  member of a ChainedOptimizer, e.g. the layer-wise distributed optimizer's): megatron saves the
  per-parameter step only when the state holds one (``common_step``), so FusedAdam's checkpoint has
  the moments and the step in the saved param groups; loaded without TE it stopped with
  ``KeyError: 'step'``. (megatron's DistributedOptimizer already converts; its load is left alone.)
- megatron's own ``init_state_fn`` for Adam writes FusedAdam's layout (its loads run it first);
- callers that fill the moments themselves, as megatron's dist_checkpointing tests do
  (``tests/unit_tests/dist_checkpointing/utils.py``, 266 of its tests failed so here).

The fix gives the inner torch Adam/AdamW of every megatron optimizer torch's own optimizer hooks:
a state without ``step`` gets the step its layout says (the param group's ``step``, FusedAdam's
count) or, when there is none, 0 (what FusedAdam reads for a missing count and what torch's first
step creates), on load (a ``load_state_dict`` pre-hook; a converted group's ``step`` is dropped so it
cannot go stale while torch's per-parameter steps count on), before each ``step()`` and in the dict
``state_dict()`` returns (the live state is not touched there). States that hold a ``step`` are never
changed, so torch's own checkpoints and running optimizers behave exactly as before.
"""

from __future__ import annotations

from typing import Any

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import OPTIMIZER

NAME = "fix-adam-state-without-step"
HOOKED = "_mindspeed_like_stepless_state_hooks"
TORCH_ADAMS = (torch.optim.Adam, torch.optim.AdamW)


def step_tensor(group: dict, param: torch.Tensor | None, count: Any = 0) -> torch.Tensor:
    """``count`` as the ``step`` tensor torch's Adam/AdamW hold (``_init_group``'s dtype and device)."""
    value = float(count.item() if torch.is_tensor(count) else count)
    if (group.get("capturable") or group.get("fused")) and param is not None:
        return torch.tensor(value, dtype=torch.float32, device=param.device)
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(value, dtype=scalar)


def _needs_step(state: Any) -> bool:
    return isinstance(state, dict) and len(state) > 0 and "step" not in state


def add_missing_steps(inner: torch.optim.Optimizer) -> None:
    """Every live state of ``inner`` (torch's Adam/AdamW) without a ``step`` gets its group's count or 0."""
    if not isinstance(inner, TORCH_ADAMS):
        return
    for group in inner.param_groups:
        for param in group["params"]:
            state = inner.state.get(param)
            if _needs_step(state):
                state["step"] = step_tensor(group, param, group.get("step", 0))


def _loaded_with_steps(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict | None:
    """``load_state_dict`` pre-hook: the per-parameter steps of a FusedAdam-layout state dict."""
    states, groups = state_dict.get("state"), state_dict.get("param_groups")
    if not isinstance(states, dict) or not isinstance(groups, list):
        return None
    if not any(_needs_step(s) for s in states.values()):
        return None
    new_groups = []
    new_states = dict(states)
    for saved, live in zip(groups, optimizer.param_groups):
        for index, key in enumerate(saved.get("params", [])):
            if _needs_step(states.get(key)):
                param = live["params"][index] if index < len(live["params"]) else None
                new_states[key] = {**states[key], "step": step_tensor(live, param, saved.get("step", 0))}
        new_groups.append({k: v for k, v in saved.items() if k != "step"})
    new_groups.extend(groups[len(new_groups) :])
    return {**state_dict, "state": new_states, "param_groups": new_groups}


def _saved_with_steps(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict | None:
    """``state_dict`` post-hook: the returned dict's stepless states get their step (copies: the live
    state is the optimizer's own and is left as it is until its next step)."""
    states = state_dict.get("state")
    if not isinstance(states, dict) or not any(_needs_step(s) for s in states.values()):
        return None
    by_index = {}
    for saved, live in zip(state_dict.get("param_groups", []), optimizer.param_groups):
        for key, param in zip(saved.get("params", []), live["params"]):
            by_index[key] = (live, param)
    new_states = dict(states)
    for key, state in states.items():
        if _needs_step(state):
            live, param = by_index.get(key, ({}, None))
            new_states[key] = {**state, "step": step_tensor(live, param, live.get("step", 0))}
    return {**state_dict, "state": new_states}


def _steps_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    add_missing_steps(optimizer)


def hook_inner_adam(inner: Any) -> None:
    """Give ``inner`` (if it is torch's Adam/AdamW, once) the three hooks."""
    if not isinstance(inner, TORCH_ADAMS) or getattr(inner, HOOKED, False):
        return
    inner.register_load_state_dict_pre_hook(_loaded_with_steps)
    inner.register_state_dict_post_hook(_saved_with_steps)
    inner.register_step_pre_hook(_steps_before_step)
    setattr(inner, HOOKED, True)


def _hooked_after_init(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    hook_inner_adam(getattr(instance, "optimizer", None))
    return result


PATCHES = [
    Patch(
        f"{OPTIMIZER}.MegatronOptimizer.__init__",
        Kind.WRAP,
        _hooked_after_init,
        why="torch's Adam behind megatron takes FusedAdam-layout states (moments, step in the group) on load, "
        "step and save",
    ),
]

FEATURE = Feature(
    name=NAME,
    summary="torch's Adam/AdamW behind megatron (no TE, no apex) load, step and save Adam states in TE's/apex's "
    "FusedAdam layout (moments without a per-parameter step): a FusedAdam checkpoint resumes without TE",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
