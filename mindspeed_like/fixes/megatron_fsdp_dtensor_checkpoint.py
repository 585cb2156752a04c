"""Fix: Megatron-FSDP's ``fsdp_dtensor`` checkpoints cannot be saved, and building a load perturbs training.

Three megatron bugs on the ``--use-megatron-fsdp --ckpt-format fsdp_dtensor`` path, none of them
device-specific (names of modules, the order of collectives, an optimizer step), measured with
Megatron-LM core_v0.16.1's pretrain_gpt.py on 2 gloo ranks (tiny GPT, SwiGLU, ``optim_grads_params``)
and with megatron-core's own API in tests/fsdp/test_megatron_fsdp_checkpoint.py. The code is the same
in megatron-core 0.19.2 and in Megatron-LM's main branch of 2026:

1. ``transformer.fsdp_dtensor_checkpoint.handle_swiglu_in_state_dict`` looks each SwiGLU ``linear_fc1``
   parameter up as ``model.get_parameter(f"module.{key}")``: the extra ``module.`` is the
   ``Float16Module`` that only a bf16/fp16 run has between ``MegatronFSDP`` and ``GPTModel``. An fp32
   run's save (and load) stops with ``AttributeError: GPTModel has no attribute `module```. The fix
   hands megatron a view of the model whose ``get_parameter`` tries megatron's name first and, only
   when that names nothing, the same name without that one ``module.`` level.

2. ``DistributedOptimizer.sharded_param_state_fsdp_dtensor`` returns the optimizer state of the
   parameters this rank holds a piece of. Megatron-FSDP shards each bucket by elements, so a small
   parameter lies wholly on one rank; on the others its gradient is set to None
   (``param_and_grad_buffer``: ``if optimizer_grad.numel() == 0: grad = None``) and Adam never makes
   its state. The ranks then hand different sets of DTensors to the save, but every DTensor costs an
   ``all_gather_object`` over its mesh (``update_uneven_dtensor_chunk_metadata``, and
   ``make_fsdp_dtensor(run_check=True)`` in the SwiGLU split): the collectives pair different tensors
   and the chunk offsets are another tensor's (bf16 run, rank 1: "DTensor chunk metadata is invalid.
   Offsets: (193, 0), Sizes: (128, 64), Global shape: torch.Size([128, 64])"; with more state on one
   side a rank waits forever). The fix gives every rank an entry, in the parameter groups' order, for
   every parameter that has state on some rank: this rank's state, or zero-size DTensors of the
   parameter's global shape and placements where this rank holds nothing of it (nothing is written
   for those, and nothing is read into them).

3. ``DistributedOptimizer._init_optimizer_states_with_dummy_values`` (called when the state dict of a
   load is built, before anything is read) takes a real optimizer step with zero gradients so that
   Adam's state exists to be loaded into. That step applies the decoupled weight decay to every
   parameter and counts a step. Megatron-LM builds that state dict for ``--load DIR`` before it knows
   DIR holds no checkpoint, so such a run trains differently from iteration 2 (lm loss 5.944815 vs
   5.933295, bf16; the distributed optimizer without FSDP is unchanged by the same ``--load``). With a
   checkpoint the loaded state overwrites both, which is why a resume hides it. Megatron-LM's main
   branch zeroes the learning rate around this step for one case (GPT->hybrid conversion), which still
   counts the step. The fix puts back what the step changed: the parameters, the state that existed
   before it, the groups' ``step``; state the step created is left as a fresh optimizer has it
   (zeros, step 0), so it is there to be loaded into and trains like no state at all otherwise.
"""

from __future__ import annotations

from typing import Any

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on

NAME = "fix-megatron-fsdp-dtensor-checkpoint"
VERSIONS = ">=0.16"
SWIGLU = "megatron.core.transformer.fsdp_dtensor_checkpoint.handle_swiglu_in_state_dict"
UNEVEN = "megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor.preprocess_state_dict_for_uneven_dtensor"
OPTIMIZER = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"


class _ParameterLookup:
    """The model as ``handle_swiglu_in_state_dict`` reads it, with ``get_parameter`` that also finds a
    parameter when megatron's name carries a ``module.`` level the model does not have (no
    ``Float16Module``: an fp32 run). Every other attribute is the model's own."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def get_parameter(self, target: str) -> Any:
        try:
            return self._model.get_parameter(target)
        except AttributeError:
            if not target.startswith("module."):
                raise
            try:
                return self._model.get_parameter(target[len("module.") :])
            except AttributeError:
                pass
            raise


def _local(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _empty_like_shard(param: Any) -> Any:
    """A DTensor with ``param``'s global shape, mesh and placements and this rank's (empty) piece."""
    import torch
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        torch.zeros_like(param._local_tensor),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


class _OptimizerState(dict):
    """The optimizer's fsdp_dtensor state dict, with the entries this rank lacks (``placeholders``:
    the ``state`` in the parameter groups' order, this rank's entries and the zero-size ones) kept
    aside. They join only the copy that is prepared for torch's checkpoint (where they pair the
    collectives), never the dict the optimizer loads afterwards: torch's Adam refuses state without
    ``step``, and a placeholder ``step`` would be saved beside the real one."""

    placeholders: dict


def state_for_every_sharded_parameter(wrapped, instance, args, kwargs):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    state_dict = wrapped(*args, **kwargs)
    packed = state_dict["state"]
    # which parameters have state somewhere, and which of its entries are DTensors (the ones that
    # cost a collective when the checkpoint is prepared)
    mine = {
        name: sorted(k for k, v in entries.items() if isinstance(v, DTensor))
        for name, entries in packed.items()
        if isinstance(name, str) and isinstance(entries, dict)
    }
    everyone: list[dict[str, list[str]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    keys_of: dict[str, list[str]] = {}
    for seen in everyone:
        for name, keys in seen.items():
            keys_of.setdefault(name, keys)
    ordered: dict = {}
    for group in instance.optimizer.param_groups:
        for param in group["params"]:
            name = instance._param_name(param)
            if name in packed:
                ordered[name] = packed[name]
            elif name in keys_of and isinstance(param, DTensor) and param._local_tensor.numel() == 0:
                with torch.no_grad():
                    ordered[name] = {key: _empty_like_shard(param) for key in keys_of[name]}
    for name, entries in packed.items():  # anything not named by a parameter group, as megatron had it
        ordered.setdefault(name, entries)
    result = _OptimizerState(state_dict)
    result.placeholders = ordered
    return result


def _with_placeholders(optimizer_state_dict: Any) -> Any:
    if not isinstance(optimizer_state_dict, _OptimizerState):
        return optimizer_state_dict
    return {**optimizer_state_dict, "state": optimizer_state_dict.placeholders}


def split_with_every_parameter(wrapped, instance, args, kwargs):
    """megatron's SwiGLU split, given the optimizer state with every rank's entries (part 2) and a model
    whose parameters are found without a Float16Module (part 1)."""
    from mindspeed_like.toolkit.binding import Call

    call = Call(wrapped, args, kwargs)
    return call(
        model=_ParameterLookup(call["model"]),
        optimizer_state_dict=_with_placeholders(call["optimizer_state_dict"]),
    )


def prepare_with_every_parameter(wrapped, instance, args, kwargs):
    """The uneven-DTensor preparation of a whole checkpoint (no SwiGLU split before it), given the
    optimizer state with every rank's entries; the caller's dict gets the prepared copy, as megatron's
    own preparation changes that dict in place."""
    from mindspeed_like.toolkit.binding import Call

    call = Call(wrapped, args, kwargs)
    state_dict = call["state_dict"]
    if isinstance(state_dict, dict) and isinstance(state_dict.get("optimizer"), _OptimizerState):
        state_dict["optimizer"] = _with_placeholders(state_dict["optimizer"])
    return wrapped(*args, **kwargs)


def dummy_step_changes_nothing(wrapped, instance, args, kwargs):
    import torch

    optimizer = instance.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with torch.no_grad():
        weights = [_local(p).clone() for p in params]
        before = {
            id(p): {k: (_local(v).clone() if torch.is_tensor(v) else v) for k, v in optimizer.state[p].items()}
            for p in params
            if p in optimizer.state
        }
        group_steps = [group.get("step") for group in optimizer.param_groups]
        result = wrapped(*args, **kwargs)
        for p, weight in zip(params, weights):
            _local(p).copy_(weight)
        for p in params:
            if p not in optimizer.state:
                continue
            state = optimizer.state[p]
            saved = before.get(id(p))
            for key, value in list(state.items()):
                if saved is not None and key in saved:
                    if torch.is_tensor(value):
                        _local(value).copy_(saved[key])
                    else:
                        state[key] = saved[key]
                elif torch.is_tensor(value):
                    _local(value).zero_()  # a fresh optimizer's state: zeros, step 0
                elif isinstance(value, (int, float)):
                    state[key] = type(value)(0)
        for group, step in zip(optimizer.param_groups, group_steps):
            if step is None:
                group.pop("step", None)
            else:
                group["step"] = step
    return result


PATCHES = [
    Patch(
        SWIGLU,
        Kind.WRAP,
        split_with_every_parameter,
        versions=VERSIONS,
        why="the SwiGLU split named parameters through a Float16Module fp32 lacks; ranks lacked optimizer entries",
    ),
    Patch(
        UNEVEN,
        Kind.WRAP,
        prepare_with_every_parameter,
        versions=VERSIONS,
        why="the uneven-DTensor preparation pairs one collective per DTensor: every rank needs every entry",
    ),
    Patch(
        f"{OPTIMIZER}.sharded_param_state_fsdp_dtensor",
        Kind.WRAP,
        state_for_every_sharded_parameter,
        versions=VERSIONS,
        why="ranks holding no piece of a parameter had no entry for it: the save's collectives mismatched",
    ),
    Patch(
        f"{OPTIMIZER}._init_optimizer_states_with_dummy_values",
        Kind.WRAP,
        dummy_step_changes_nothing,
        versions=VERSIONS,
        why="the zero-gradient step that makes Adam's state for a load decayed the weights and counted a step",
    ),
]

FEATURE = Feature(
    name=NAME,
    summary="--use-megatron-fsdp --ckpt-format fsdp_dtensor saves (fp32 SwiGLU names; every rank an entry for "
    "every parameter's optimizer state, so the save's collectives pair) and --load without a checkpoint trains "
    "as no --load (the dummy optimizer step made to load into is undone)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
