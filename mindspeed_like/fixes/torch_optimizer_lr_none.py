"""Fix: megatron's optimizer without TransformerEngine or apex refuses ``OptimizerConfig(lr=None)``.

``OptimizerConfig.lr`` defaults to None: the learning rate is the param scheduler's to set
(``OptimizerParamScheduler`` writes every group's ``lr`` before the first step; Megatron-LM's
training loop always builds one). With TE's or apex's ``FusedAdam``/``FusedSGD`` a None ``lr`` is
accepted at construction. Without them megatron-core takes torch's ``AdamW``/``Adam``/``SGD``
(its ``USING_PYTORCH_OPTIMIZER`` path), whose constructors check ``0.0 <= lr``: ``TypeError: '<='
not supported between instances of 'float' and 'NoneType'`` from ``get_megatron_optimizer``
(megatron's own tests/unit_tests/test_optimizer.py::test_optim_sharded_state_dict, bf16 and the
distributed optimizer, fail so on every host without TE or apex).

The fix: where megatron-core builds torch's optimizer and ``config.lr`` is None,
``_get_megatron_optimizer_based_on_param_groups`` runs with ``config.lr = 0.0`` (only torch's
check reads it there) and every param group that had no ``lr`` of its own gets ``lr = None`` back
afterwards: the state TE's optimizer is in, so a step before the scheduler sets the learning rate
still fails loudly (torch's step with ``lr=None``), never trains at a placeholder rate.
``config.lr`` is None again on return. With ``lr`` given, or with TE/apex, nothing changes.
"""

from __future__ import annotations

import sys

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-torch-optimizer-lr-none"
OPTIMIZER = "megatron.core.optimizer"
PLACEHOLDER = 0.0  # what torch's constructors check; no step ever runs at it (set back to None)


def _builds_torch_optimizer() -> bool:
    """Whether megatron-core's optimizer module took torch's optimizers (no TE, no apex)."""
    module = sys.modules.get(OPTIMIZER)
    adam = getattr(module, "Adam", None)
    return bool(getattr(module, "USING_PYTORCH_OPTIMIZER", False)) or (
        isinstance(adam, type) and issubclass(adam, torch.optim.Optimizer) and adam.__module__.startswith("torch.")
    )


def _torch_optimizers(result) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside what megatron built (its wrapper's ``.optimizer``, chained
    optimizers' ``chained_optimizers``, or 0.19's ``(optimizer, init_fn)`` without wrapping)."""
    found: list[torch.optim.Optimizer] = []
    pending = list(result) if isinstance(result, tuple) else [result]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.optim.Optimizer) and not hasattr(item, "optimizer"):
            found.append(item)
        elif item is not None:
            pending += list(getattr(item, "chained_optimizers", []) or [])
            inner = getattr(item, "optimizer", None)
            if inner is not None and inner is not item:
                pending.append(inner)
    return found


def _lr_left_to_the_scheduler(wrapped, instance, args, kwargs):
    call = Call(wrapped, args, kwargs)
    config = call["config"]
    if getattr(config, "lr", 0.0) is not None or not _builds_torch_optimizer():
        return wrapped(*args, **kwargs)
    own_lr = ["lr" in group for group in call["param_groups"]]
    config.lr = PLACEHOLDER
    try:
        result = wrapped(*args, **kwargs)
    finally:
        config.lr = None
    for optimizer in _torch_optimizers(result):
        groups = optimizer.param_groups
        # megatron's wrappers keep the groups' order (the distributed optimizer's hold shards, not
        # the same tensors); where the count differs, the placeholder itself marks them
        keep = own_lr if len(own_lr) == len(groups) else [group.get("lr") != PLACEHOLDER for group in groups]
        for group, has_own in zip(groups, keep):
            if not has_own:
                group["lr"] = None
    return result


PATCHES = [
    Patch(
        f"{OPTIMIZER}._get_megatron_optimizer_based_on_param_groups",
        Kind.WRAP,
        _lr_left_to_the_scheduler,
        why="torch's AdamW/Adam/SGD (megatron's no-TE/apex path) refuse OptimizerConfig's default lr=None",
        # outermost: the placeholder reaches whichever optimizer the inner wrapper builds, and the
        # groups are set back to None whoever built them
        after=("precision-aware-optimizer",),
    )
]

FEATURE = Feature(
    name=NAME,
    summary="OptimizerConfig(lr=None) (the scheduler sets the rate) builds megatron's optimizer on torch's AdamW/SGD "
    "too (was TypeError without TE or apex)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
