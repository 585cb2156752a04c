"""Fix: with ``--decoupled-lr`` a resumed run trains its parameters at another group's learning rate
(DistributedOptimizer) or cannot load at all (Float16 optimizer); megatron-core 0.16-0.18.

On load megatron pairs each parameter group of the running optimizer with a group of the
checkpoint by the tuple ``param_group_identifier_keys = (wd_mult, lr_mult, is_expert_parallel,
is_decoupled_lr)``, collected in a dict (``DistributedOptimizer.load_state_dict``: ``param_groups_map``;
``MegatronOptimizer._filter_and_reorder_param_groups``: ``loaded_groups_map``). Up to 0.15
``_get_param_groups`` set ``is_decoupled_lr=True`` on the embedding/output group. From 0.16 the
groups come from ``get_standard_config_overrides``, where decoupled lr is only a ``max_lr`` /
``min_lr`` override (optimizer/__init__.py, ``decoupled_lr_config``) and every group keeps
``is_decoupled_lr=False``: the decoupled group and the default group have the same tuple, the
dict keeps the last one, and both running groups are paired with it. Measured through Megatron-LM
core_v0.16.1 pretrain_gpt.py (DP=2, bf16, ``--decoupled-lr 5e-4 --decoupled-min-lr 4.5e-5``,
train 3, save in torch_dist, load in new processes; the import line alone):

* DistributedOptimizer: the default group loads ``max_lr=5e-4, min_lr=4.5e-5`` (its own are 1e-3
  and 0): iteration 4's update runs at the wrong rate, grad norm at iteration 5 1.222 vs 1.218
  straight, losses drift (5.446527 vs 5.427997);
* Float16 optimizer: both groups become the SAME dict (megatron sets ``group['params']`` on it
  twice), torch's ``load_state_dict`` raises ``ValueError: loaded state dict contains a parameter
  group that doesn't match the size of optimizer's group``.

megatron-core 0.19 pairs by every key of ``ParamGroupOverride`` (``max_lr``, ``min_lr``,
``start_wd``, ``end_wd``, ``wd_mult``) plus the three flags (missing keys as None). Here, on the
releases with the collision, megatron's pairing is kept wherever its tuple is unambiguous; where
several checkpoint groups share a tuple, the one with the same 0.19 identity is taken (both key
lists read from the installed megatron). If none or several match (e.g. ``--lr`` or
``--decoupled-lr`` changed between save and load, which 0.19 refuses too), a ValueError names the
groups instead of a silent wrong pairing.

Targets: ``MegatronOptimizer._filter_and_reorder_param_groups`` (Float16 / FP32 optimizers: the
pairing itself; on a collision ours runs instead of megatron's) and
``DistributedOptimizer.load_state_dict`` (its pairing is a closure inside; after megatron's load,
each group paired with the wrong checkpoint group gets the right group's hyperparameters, exactly
the dict megatron would have built: the checkpoint group with the running group's ``params``).
"""

from __future__ import annotations

import copy
import sys
from collections import defaultdict
from typing import Any

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.targets import DISTRIB_OPTIMIZER, OPTIMIZER

VERSIONS = ">=0.16,<0.19"  # 0.16: decoupled lr became a max_lr override; 0.19 pairs by every override key
DISTOPT = f"{DISTRIB_OPTIMIZER}.DistributedOptimizer"
HOST = "cpu-adapter"
APEX_FIX = "fix-distopt-checkpoint-without-apex"
REUSE = "reuse-fp32-param"

Group = dict[str, Any]


def megatron_keys() -> tuple[str, ...]:
    """The keys the installed megatron pairs groups by."""
    return tuple(sys.modules[OPTIMIZER].param_group_identifier_keys)


def identity_keys() -> tuple[str, ...]:
    """megatron-core 0.19's pairing keys: every field of ``ParamGroupOverride``, then megatron's own."""
    from megatron.core.optimizer_param_scheduler import ParamGroupOverride

    overrides = tuple(sorted(ParamGroupOverride.__annotations__))
    return overrides + tuple(key for key in megatron_keys() if key not in overrides)


def group_key(group: Group, keys: tuple[str, ...]) -> tuple:
    """``group``'s values of ``keys`` (NeMo's ``pre_`` spelling accepted, as megatron does; missing: None)."""
    return tuple(group[key] if key in group else group.get(f"pre_{key}") for key in keys)


def pair_groups(current: list[Group], saved: list[Group]) -> list[int] | None:
    """For each running group, the index of its checkpoint group; None where megatron's own pairing
    is unambiguous (no two checkpoint groups share its tuple), so megatron's code decides alone."""
    by_key: dict[tuple, list[int]] = defaultdict(list)
    keys = megatron_keys()
    for index, group in enumerate(saved):
        by_key[group_key(group, keys)].append(index)
    if all(len(indices) == 1 for indices in by_key.values()):
        return None
    identity = identity_keys()
    pairs = []
    for group in current:
        candidates = by_key.get(group_key(group, keys), [])
        if len(candidates) > 1:
            wanted = group_key(group, identity)
            candidates = [j for j in candidates if group_key(saved[j], identity) == wanted]
            if len(candidates) != 1:
                raise ValueError(
                    f"cannot tell which checkpoint parameter group belongs to the running group "
                    f"{dict(zip(identity, wanted))}: megatron pairs groups by {keys}, which several "
                    f"checkpoint groups share, and {len(candidates)} of them also have the same "
                    f"{identity} (megatron-core 0.19's rule). Resume with the learning-rate and weight-decay "
                    "settings the checkpoint was saved with (--lr, --min-lr, --decoupled-lr, --decoupled-min-lr)."
                )
        if not candidates:
            return None  # megatron raises its own "not found" error
        pairs.append(candidates[0])
    return pairs


def _reorder_groups(wrapped, instance, args, kwargs):
    current, saved = _bind_reorder(*args, **kwargs)
    pairs = pair_groups(current, saved)
    if pairs is None:
        return wrapped(*args, **kwargs)
    # megatron's result, built from distinct dicts: the paired checkpoint group's hyperparameters with
    # the params of the checkpoint's group at this position (order decided at runtime, see megatron)
    return [{**saved[j], "params": saved[i]["params"]} for i, j in enumerate(pairs)]


def _bind_reorder(current_groups: list[Group], state_dict_groups: list[Group]) -> tuple:
    """megatron's signature: ``_filter_and_reorder_param_groups(current_groups, state_dict_groups)``."""
    return current_groups, state_dict_groups


def _load_with_own_groups(wrapped, instance, args, kwargs):
    state_dict = _bind_load(*args, **kwargs)
    if getattr(getattr(instance, "ddp_config", None), "use_megatron_fsdp", False):
        return wrapped(*args, **kwargs)  # megatron FSDP maps groups through param_to_group_meta
    saved = [{k: v for k, v in group.items() if k != "params"} for group in state_dict["optimizer"]["param_groups"]]
    current = instance.optimizer.param_groups
    pairs = pair_groups(current, saved)
    if pairs is None:
        return wrapped(*args, **kwargs)
    keys = megatron_keys()
    megatron_pick = {group_key(group, keys): j for j, group in enumerate(saved)}  # the dict: last one wins
    picked = [megatron_pick[group_key(group, keys)] for group in current]
    result = wrapped(*args, **kwargs)
    for group, wrong, right in zip(instance.optimizer.param_groups, picked, pairs):
        if wrong == right:
            continue
        for key in saved[wrong]:
            if key not in saved[right]:
                group.pop(key, None)
        group.update(copy.deepcopy(saved[right]))
    return result


def _bind_load(state_dict: dict) -> dict:
    """megatron's signature: ``DistributedOptimizer.load_state_dict(self, state_dict)``."""
    return state_dict


PATCHES = [
    Patch(
        f"{OPTIMIZER}.MegatronOptimizer._filter_and_reorder_param_groups",
        Kind.WRAP,
        _reorder_groups,
        versions=VERSIONS,
        why="groups sharing megatron's pairing tuple (decoupled lr) are told apart by their max_lr/min_lr",
    ),
    Patch(
        f"{DISTOPT}.load_state_dict",
        Kind.WRAP,
        _load_with_own_groups,
        versions=VERSIONS,
        after=(HOST,),
        before=(APEX_FIX, REUSE),
        why="a group paired with the wrong checkpoint group (decoupled lr) gets its own group's hyperparameters",
    ),
]

FEATURE = Feature(
    name="fix-decoupled-lr-resume",
    summary="--decoupled-lr runs resume exactly on megatron-core 0.16-0.18 (each parameter group loads its own "
    "checkpoint group, not the one sharing megatron's pairing tuple)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
