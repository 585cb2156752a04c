"""Fix: a DistributedOptimizer checkpoint cannot be resumed where megatron found no apex and no TE.

Without apex or TransformerEngine (every CPU host, and NPU/ROCm/GPU hosts without them)
``distrib_optimizer.HAVE_APEX_OR_TE`` is False and megatron's DistributedOptimizer drives torch's
own Adam, which keeps a ``step`` tensor PER PARAMETER. megatron's code for that branch breaks
every checkpoint format on resume (measured on 0.13-0.19, DP=2, a tiny GPT):

* ``DistributedOptimizer.state_dict`` takes the step from the inner state and asserts it is one
  value; a freshly built optimizer (the one a run resumes into) has no state yet, so building
  the sharded state dict to LOAD into fails with ``assert len(steps) == 1``
  (``dp_reshardable``, ``fully_reshardable``, ``fully_sharded_model_space``). Here a fresh
  optimizer reports step 0 for its groups (it has taken no step), through megatron's own code:
  each parameter gets a transient ``{"step": 0}`` state for the call, removed afterwards. (States
  holding moments but no step, FusedAdam's layout, are fix-adam-state-without-step's.)
  A rank whose shard of the optimizer holds no parameter at all (MoE layers on some pipeline
  stages only, ``moe_layer_freq``: the stages without them) has no state to read a step from and
  failed the same assertion at every save. Here it reports the steps this DistributedOptimizer
  has taken (counted at each successful ``step_with_ready_grads``, set from the checkpoint at
  ``load_state_dict``), through a transient state under a non-tensor key, which torch's
  ``Optimizer.state_dict`` keeps as it is.
* ``DistributedOptimizer.load_state_dict`` gives every parameter the SAME step tensor; torch's
  Adam increments its step in place once per parameter, so after a resume the bias correction
  counts parameters, not steps, and the run drifts from the uninterrupted one. Here each
  parameter gets its own copy, as torch's Adam creates them.
* ``_set_main_param_and_optimizer_states`` (the legacy ``load_parameter_state`` and
  ``dp_reshardable`` paths) copies every key of the parameter's optimizer state, ``step``
  included, from the loaded tensors, which never carry a step (it is saved in the param groups):
  ``KeyError: 'step'``; ``dp_reshardable`` hands back, as the loaded ``step``, the live tensor it
  was given when the state dict was built (a non-persistent object), so the resumed run restarts
  its bias correction at the fresh optimizer's step. With an fp32 model the main parameter is a
  view of the model's leaf parameter and the legacy path does not run under ``no_grad``: "a view
  of a leaf Variable that requires grad is being used in an in-place operation". Here the step is
  always the one ``load_state_dict`` just set from the checkpoint's param groups, and the copy
  runs under ``no_grad`` (megatron's other load paths already do).
* ``get_parameter_state_fs_bucket_space`` (0.13/0.14's ``fully_sharded_bucket_space``) puts the
  0-dim step among each parameter's bucket tensors, and the save asserts every one has the
  parameter's length. Here the step is left out (it is saved in the param groups).

Each wrapper does nothing when megatron took its apex/TE branch (``HAVE_APEX_OR_TE`` read at
call time from the installed module) or when the inner optimizer keeps no per-parameter step.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import DISTRIB_OPTIMIZER

DISTOPT = f"{DISTRIB_OPTIMIZER}.DistributedOptimizer"
# Stacking: megatron's body (a host twin on CPU) innermost, these fixes right above it, and
# reuse-fp32-param's "materialize the masters first" outermost.
HOST = "cpu-adapter"
REUSE = "reuse-fp32-param"


def _torch_adam_branch() -> bool:
    """True where megatron's DistributedOptimizer keeps torch's per-parameter ``step``."""
    return not getattr(sys.modules[DISTRIB_OPTIMIZER], "HAVE_APEX_OR_TE", True)


def _inner_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


# the inner state's key for the steps of a shard without parameters (not a tensor: torch's
# Optimizer.state_dict packs tensor keys by index and keeps other keys as they are)
STEPS_ONLY = "mindspeed_like:steps-taken"


def _state_dict_of_fresh_optimizer(wrapped, instance, args, kwargs):
    inner = instance.optimizer
    if not _torch_adam_branch() or not isinstance(inner, torch.optim.Optimizer):
        return wrapped(*args, **kwargs)
    params = _inner_params(inner)
    if params:
        # a fresh optimizer: every parameter (states holding moments without a step, FusedAdam's layout,
        # get theirs in the inner optimizer's state_dict: fix-adam-state-without-step)
        steps = {param: 0.0 for param in params} if len(inner.state) == 0 else {}
    else:  # a shard without parameters: the steps this optimizer has taken, under a non-tensor key
        steps = {STEPS_ONLY: float(getattr(instance, "_steps_taken", 0))}
    for key, step in steps.items():
        inner.state.setdefault(key, {})["step"] = torch.tensor(step)
    try:
        return wrapped(*args, **kwargs)
    finally:
        for key in steps:
            inner.state[key].pop("step", None)
            if not inner.state[key]:
                del inner.state[key]


def _count_steps(wrapped, instance, args, kwargs):
    """The steps taken, for a shard without parameters to report (torch's Adam counts per parameter)."""
    success = wrapped(*args, **kwargs)
    if success:
        instance._steps_taken = getattr(instance, "_steps_taken", 0) + 1
    return success


def _loaded_step(state_dict: Any) -> int | None:
    groups = state_dict.get("optimizer", {}).get("param_groups", []) if isinstance(state_dict, dict) else []
    steps = {group["step"] for group in groups if isinstance(group.get("step"), (int, float))}
    return int(steps.pop()) if len(steps) == 1 else None


def _load_state_dict_with_own_steps(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    inner = instance.optimizer
    if _torch_adam_branch() and isinstance(inner, torch.optim.Optimizer):
        loaded = _loaded_step(args[0] if args else kwargs.get("state_dict"))
        if loaded is not None:
            instance._steps_taken = loaded
        for state in inner.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.detach().clone()
    return result


def _set_states_keeping_step(wrapped, instance, args, kwargs):
    model_param, tensors = _bind_set_states(*args, **kwargs)
    if _torch_adam_branch():
        current = _current_state(instance, model_param)
        if "step" in current:
            # the step was just set from the checkpoint's param groups by load_state_dict; a
            # "step" among the loaded tensors is not from the checkpoint (dp_reshardable hands
            # back the live tensor it was given, a LocalNonpersistentObject)
            tensors = {**tensors, "step": current["step"]}
    with torch.no_grad():
        return wrapped(model_param, tensors)


def _bucket_space_without_step(wrapped, instance, args, kwargs):
    state = wrapped(*args, **kwargs)
    if _torch_adam_branch():
        for gbuf_index, per_dtype in state.items():
            if not isinstance(gbuf_index, int):
                continue  # per_bucket_numel and the like
            for buckets in per_dtype.values():
                for bucket in buckets:
                    for tensors in bucket:
                        tensors.pop("step", None)
    return state


def _bind_set_states(model_param: torch.nn.Parameter, tensors: dict[str, Any]) -> tuple:
    """megatron's signature: ``_set_main_param_and_optimizer_states(self, model_param, tensors)``."""
    return model_param, tensors


def _current_state(distopt: Any, model_param: torch.nn.Parameter) -> dict:
    """The inner optimizer's state of the main parameter that shards ``model_param`` here."""
    group_index, group_order = distopt.model_param_group_index_map[model_param]
    main_param = distopt.optimizer.param_groups[group_index]["params"][group_order]
    return distopt.optimizer.state.get(main_param, {})


PATCHES = [
    Patch(
        f"{DISTOPT}.state_dict",
        Kind.WRAP,
        _state_dict_of_fresh_optimizer,
        why="a fresh optimizer (no step yet) reports step 0 instead of failing `assert len(steps) == 1`",
        before=(REUSE,),
    ),
    Patch(
        f"{DISTOPT}.load_state_dict",
        Kind.WRAP,
        _load_state_dict_with_own_steps,
        why="each parameter gets its own step tensor (torch's Adam increments it in place per parameter)",
        after=(HOST,),
        before=(REUSE,),
    ),
    Patch(
        f"{DISTOPT}.step_with_ready_grads",
        Kind.WRAP,
        _count_steps,
        why="a shard without parameters has no per-parameter step to save: the optimizer counts its steps",
    ),
    Patch(
        f"{DISTOPT}._set_main_param_and_optimizer_states",
        Kind.WRAP,
        _set_states_keeping_step,
        why="loaded parameter state never carries `step` (KeyError); fp32 main params are leaf views (no_grad)",
        before=(REUSE,),
    ),
]

PATCHES.append(
    Patch(
        f"{DISTOPT}.get_parameter_state_fs_bucket_space",
        Kind.WRAP,
        _bucket_space_without_step,
        versions="<0.15",  # 0.15 renamed the format dp_reshardable and skips the step itself
        before=(REUSE,),
        why="the 0-dim per-parameter step is not bucket state (its save asserted a [numel] shape)",
    )
)

FEATURE = Feature(
    name="fix-distopt-checkpoint-without-apex",
    summary="DistributedOptimizer checkpoints save and resume exactly where megatron drives torch's Adam "
    "(no apex, no TransformerEngine)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
