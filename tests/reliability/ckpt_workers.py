"""DistributedOptimizer save and resume on CPU, as a user's training script does it (issues 15, 28).

Each phase runs in its own processes (``run_distributed``, DP=2): train 3 steps and save;
then, in FRESH processes, build the model and optimizer anew, load, train 3 more; and, for the
reference, train 6 straight. Everything a run needs after the load must come from the checkpoint.

The model, the optimizer and megatron's training schedule are the user-script tests' own
(``tests/adapters/user_script_workers``): plain megatron-core, our import only through
``mindspeed_like.configure``. The setups (:data:`SETUPS`): fp32 (megatron's default optimizer),
bf16 with reuse-fp32-param, and bf16 with megatron's precision-aware optimizer
(``use_precision_aware_optimizer=True``, bf16 main grads, int16 master remainders, bf16 or fp8
moments), which without TE runs ``mindspeed_like.kernels.adam.PrecisionAwareAdam``.

The checkpoint formats are megatron's:

* ``legacy``: Megatron-LM's ``--ckpt-format torch``: each rank's ``model.state_dict()`` and the
  optimizer's ``state_dict()`` (no parameter state), plus the parameter state gathered to DP
  rank 0 by ``save_parameter_state`` / scattered by ``load_parameter_state``;
* ``dp_reshardable``, ``fully_reshardable`` (0.15+; ``fully_sharded_bucket_space`` and
  ``dp_zero_gather_scatter`` before), ``fully_sharded_model_space`` (megatron-core's default):
  ``dist_checkpointing.save/load`` of the model's and the optimizer's ``sharded_state_dict``
  with ``metadata={"distrib_optim_sharding_type": ...}``, loaded with ``strict=`` the
  ``--dist-ckpt-strictness`` value (Megatron-LM passes it to ``dist_checkpointing.load``).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "adapters"))

from user_script_workers import SEQ, VOCAB, build  # noqa: E402
from user_script_workers import train as train_steps  # noqa: E402

SETUPS = ("plain", "reuse", "pa-bf16", "pa-fp8")
"""plain: fp32 model, megatron's optimizer; reuse: bf16 + reuse-fp32-param; pa-bf16 / pa-fp8:
bf16 + the precision-aware optimizer with bf16 main grads, remainders and bf16 / fp8 moments."""
MOMENTS = {"pa-bf16": torch.bfloat16, "pa-fp8": torch.uint8}  # megatron spells fp8 torch.uint8


def _setup(setup: str):
    import mindspeed_like
    from mindspeed_like.testing import init_parallel

    reuse = setup == "reuse"
    mindspeed_like.configure(device="cpu", reuse_fp32_param=reuse)
    init_parallel()  # world 2 -> DP=2
    if setup in MOMENTS:
        return _build_precision_aware(MOMENTS[setup])
    # bf16 with reuse (the feature shares bf16/fp32 storage), fp32 without
    return build(bf16=reuse, distributed_optimizer=True)


def _build_precision_aware(moments: torch.dtype):
    """``user_script_workers.build(bf16=True, distributed_optimizer=True)`` (the same seeds, model,
    Float16Module and DDP) with megatron's precision-aware optimizer as Megatron-LM's
    ``--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype X --exp-avg-sq-dtype X``
    sets it: bf16 grad buffers (no ``grad_reduce_in_fp32``, which that build hard-codes for bf16),
    ``store_param_remainders`` left at megatron's default (True)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(123)
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    cfg.finalize_model_grads_func = finalize_model_grads
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, SEQ)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=False)
    model = DistributedDataParallel(cfg, ddp_config, Float16Module(cfg, gpt))
    assert parallel_state.get_data_parallel_world_size() == 2
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            bf16=True,
            use_distributed_optimizer=True,
            clip_grad=1.0,
            use_precision_aware_optimizer=True,
            main_grads_dtype=torch.bfloat16,
            exp_avg_dtype=moments,
            exp_avg_sq_dtype=moments,
        ),
        [model],
    )
    return model, optimizer


def _bits(value: torch.Tensor):
    """A tensor as a numpy array by value (bf16 as its bits)."""
    value = value.detach().cpu()
    return (value.view(torch.int16) if value.dtype == torch.bfloat16 else value).numpy().copy()


def _weights(model) -> dict:
    """This rank's model weights, as numpy arrays by value (bf16 as its bits)."""
    out = {}
    for name, param in model.module.state_dict().items():
        if isinstance(param, torch.Tensor) and param.is_floating_point():
            out[name] = _bits(param)
    return out


def _optimizer_state(optimizer) -> dict:
    """This rank's optimizer state by value: every param the inner optimizer steps (the fp32 main
    shards, or the bf16 shards for the precision-aware one), each of its states (moments in their
    storage dtype, int16 remainders, torch's step), each group's step, and the block scales of
    PrecisionAwareAdam's fp16/fp8 states."""
    inner = optimizer.optimizer
    # PrecisionAwareAdam (like TE's FusedAdam) counts steps per group; torch's Adam per param
    # (its state's `step`, compared below). megatron's load also writes a `step` into torch's
    # param_groups, which torch's Adam never reads and a straight run never has: not compared.
    group_steps = hasattr(inner, "_buckets")
    out = {}
    for g, group in enumerate(inner.param_groups):
        if group_steps:
            out[f"group{g}.step"] = group["step"]
        for i, param in enumerate(group["params"]):
            out[f"group{g}.{i}.param"] = _bits(param)
            for name, value in inner.state[param].items():
                if isinstance(value, torch.Tensor):
                    out[f"group{g}.{i}.{name}"] = _bits(value)
    buckets = {id(b): b for b in getattr(inner, "_buckets", {}).values()}
    for b, bucket in enumerate(buckets.values()):
        for name, store in bucket.stores.items():
            if store.scales is not None:
                out[f"bucket{b}.{name}.scales"] = _bits(store.scales)
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


def _load(model, optimizer, fmt: str, directory: str, strict: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if fmt == "legacy":
        state = torch.load(f"{directory}/rank{dist.get_rank()}.pt", weights_only=False)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        optimizer.load_parameter_state(f"{directory}/distrib_optim.pt")
    else:
        loaded = dist_checkpointing.load(_sharded(model, optimizer, fmt, loading=True), directory, strict=strict)
        model.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])


def straight(steps: int, setup: str) -> dict:
    model, optimizer = _setup(setup)
    losses = train_steps(model, optimizer, 0, steps)
    return {"losses": losses, "weights": _weights(model), "optimizer": _optimizer_state(optimizer)}


def train_and_save(steps: int, fmt: str, directory: str, setup: str) -> dict:
    model, optimizer = _setup(setup)
    losses = train_steps(model, optimizer, 0, steps)
    _save(model, optimizer, fmt, directory)
    return {"losses": losses}


def load_and_train(first_step: int, steps: int, fmt: str, directory: str, setup: str, strict: str) -> dict:
    model, optimizer = _setup(setup)  # fresh weights and optimizer
    _load(model, optimizer, fmt, directory, strict)
    losses = train_steps(model, optimizer, first_step, steps)
    return {"losses": losses, "weights": _weights(model), "optimizer": _optimizer_state(optimizer)}
