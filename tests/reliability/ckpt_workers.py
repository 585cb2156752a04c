"""DistributedOptimizer save and resume on CPU, as a user's training script does it (issue 15).

Each phase runs in its own processes (``run_distributed``, DP=2): train 3 steps and save;
then, in FRESH processes, build the model and optimizer anew, load, train 3 more; and, for the
reference, train 6 straight. Everything a run needs after the load must come from the checkpoint.

The model, the optimizer and megatron's training schedule are the user-script tests' own
(``tests/adapters/user_script_workers``): plain megatron-core, our import only through
``mindspeed_like.configure``. The checkpoint formats are megatron's:

* ``legacy``: Megatron-LM's ``--ckpt-format torch``: each rank's ``model.state_dict()`` and the
  optimizer's ``state_dict()`` (no parameter state), plus the parameter state gathered to DP
  rank 0 by ``save_parameter_state`` / scattered by ``load_parameter_state``;
* ``dp_reshardable``, ``fully_reshardable`` (0.15+; ``fully_sharded_bucket_space`` and
  ``dp_zero_gather_scatter`` before), ``fully_sharded_model_space`` (megatron's default):
  ``dist_checkpointing.save/load`` of the model's and the optimizer's ``sharded_state_dict``
  with ``metadata={"distrib_optim_sharding_type": ...}``.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "adapters"))

from user_script_workers import build, train  # noqa: E402


def _setup(reuse_fp32_param: bool):
    import mindspeed_like
    from mindspeed_like.testing import init_parallel

    mindspeed_like.configure(device="cpu", reuse_fp32_param=reuse_fp32_param)
    init_parallel()  # world 2 -> DP=2
    # bf16 with reuse (the feature shares bf16/fp32 storage), fp32 without
    return build(bf16=reuse_fp32_param, distributed_optimizer=True)


def _weights(model) -> dict:
    """This rank's model weights, as numpy arrays by value (bf16 as its bits)."""
    out = {}
    for name, param in model.module.state_dict().items():
        if isinstance(param, torch.Tensor) and param.is_floating_point():
            value = param.detach().cpu()
            out[name] = (value.view(torch.int16) if value.dtype == torch.bfloat16 else value).numpy().copy()
    return out


def _sharded(model, optimizer, fmt: str, *, loading: bool) -> dict:
    metadata = {"distrib_optim_sharding_type": fmt}
    state = {"model": model.module.sharded_state_dict(metadata=metadata)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
    return state


def _save(model, optimizer, fmt: str, directory: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    dist.barrier()
    rank = dist.get_rank()
    if fmt == "legacy":
        torch.save(
            {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
            f"{directory}/rank{rank}.pt",
        )
        optimizer.save_parameter_state(f"{directory}/distrib_optim.pt")
    else:
        dist_checkpointing.save(_sharded(model, optimizer, fmt, loading=False), directory)
    dist.barrier()


def _load(model, optimizer, fmt: str, directory: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if fmt == "legacy":
        state = torch.load(f"{directory}/rank{dist.get_rank()}.pt", weights_only=False)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        optimizer.load_parameter_state(f"{directory}/distrib_optim.pt")
    else:
        loaded = dist_checkpointing.load(_sharded(model, optimizer, fmt, loading=True), directory)
        model.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])


def straight(steps: int, reuse_fp32_param: bool) -> dict:
    model, optimizer = _setup(reuse_fp32_param)
    losses = train(model, optimizer, 0, steps)
    return {"losses": losses, "weights": _weights(model)}


def train_and_save(steps: int, fmt: str, directory: str, reuse_fp32_param: bool) -> dict:
    model, optimizer = _setup(reuse_fp32_param)
    losses = train(model, optimizer, 0, steps)
    _save(model, optimizer, fmt, directory)
    return {"losses": losses}


def load_and_train(first_step: int, steps: int, fmt: str, directory: str, reuse_fp32_param: bool) -> dict:
    model, optimizer = _setup(reuse_fp32_param)  # fresh weights and optimizer
    _load(model, optimizer, fmt, directory)
    losses = train(model, optimizer, first_step, steps)
    return {"losses": losses, "weights": _weights(model)}
