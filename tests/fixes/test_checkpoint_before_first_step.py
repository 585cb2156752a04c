"""fix-checkpoint-before-first-step (issue 49 item 5): a checkpoint saved before the optimizer's first
step loads.

fp16 with megatron's default ``--initial-loss-scale`` (2**32) skips the first steps, so an early
``--save`` held no Adam moments and the load, which initialises them first and asks the checkpoint
for them, stopped with ``KeyError: "optimizer.state.exp_avg... from model not in state dict"``
(Float16 optimizer) or ``"...bucket_idx_0.exp_avg from model not in state dict"``
(DistributedOptimizer). Here megatron-core's own save and load (``dist_checkpointing``, as
Megatron-LM's ``--ckpt-format torch_dist`` calls them) of a model whose optimizer has not stepped,
into a freshly built one; the run through Megatron-LM's pretrain_gpt.py is
tests/reliability/test_megatron_lm_host_flags.py (opt-in).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from packaging.version import Version

from mindspeed_like.megatron_version import megatron_core_version

VOCAB, SEQ = 64, 16
# megatron-core 0.13/0.14 declare numpy<2; with numpy 2 (installed with --no-deps) the DistributedOptimizer's
# model-space checkpoint calls np.product, which numpy 2 removed (tests/reliability/test_distopt_checkpoint_resume.py)
OLD_DISTOPT_NEEDS_NUMPY_1 = pytest.mark.xfail(
    (megatron_core_version() or Version("999")) < Version("0.15") and Version(np.__version__) >= Version("2"),
    reason="megatron-core < 0.15 calls np.product (removed in numpy 2) in its DistributedOptimizer checkpoint",
    raises=AttributeError,
    strict=True,
)


def _build(fp16: bool, distributed_optimizer: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(123)
    dtype = torch.float16 if fp16 else torch.float32
    cfg = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, fp16=fp16, params_dtype=dtype, pipeline_dtype=dtype
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, SEQ)
    if fp16:
        model = Float16Module(cfg, model)
    model = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer), model
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, fp16=fp16, use_distributed_optimizer=distributed_optimizer),
        [model],
    )
    return model, optimizer


def _state(model, optimizer, loading: bool) -> dict:
    state = {"model": model.module.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading)
    return state


def _inner_states(optimizer) -> list[dict]:
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer.state.get(p, {}) for o in optimizers for g in o.optimizer.param_groups for p in g["params"]]


@pytest.mark.parametrize(
    ("fp16", "distributed_optimizer"),
    [
        pytest.param(True, False, id="float16-optimizer"),
        pytest.param(False, False, id="fp32-optimizer"),
        pytest.param(True, True, id="distributed-optimizer", marks=OLD_DISTOPT_NEEDS_NUMPY_1),
    ],
)
def test_a_checkpoint_saved_before_the_first_step_loads(adaptor, tmp_path, fp16, distributed_optimizer):
    from megatron.core import dist_checkpointing

    from mindspeed_like.testing import init_parallel

    init_parallel()
    model, optimizer = _build(fp16, distributed_optimizer)
    assert all(len(s) == 0 for s in _inner_states(optimizer)), "the optimizer has stepped: not the case under test"
    dist_checkpointing.save(_state(model, optimizer, loading=False), str(tmp_path))
    # the saving run's optimizer is left as it was: its first step initialises its state as before
    assert all(len(s) == 0 for s in _inner_states(optimizer))

    fresh_model, fresh = _build(fp16, distributed_optimizer)
    loaded = dist_checkpointing.load(_state(fresh_model, fresh, loading=True), str(tmp_path))
    fresh_model.module.load_state_dict(loaded["model"])
    fresh.load_state_dict(loaded["optimizer"])
    # the loaded state is the one torch's Adam makes at the first step: zero moments, step 0
    states = _inner_states(fresh)
    assert states and all(set(s) >= {"exp_avg", "exp_avg_sq", "step"} for s in states), [sorted(s) for s in states]
    for s in states:
        assert not s["exp_avg"].any() and not s["exp_avg_sq"].any() and float(s["step"]) == 0.0


@pytest.mark.parametrize(
    "distributed_optimizer",
    [
        pytest.param(False, id="float16-optimizer"),
        pytest.param(True, id="distributed-optimizer", marks=OLD_DISTOPT_NEEDS_NUMPY_1),
    ],
)
def test_init_state_fn_makes_states_torch_adam_can_step_and_save(adaptor, tmp_path, distributed_optimizer):
    """megatron's init_state_fn wrote FusedAdam's state (moments, no step); torch's Adam then raised
    KeyError: 'step' at its next step, and the DistributedOptimizer's state_dict at the save (megatron's
    dist_checkpointing/test_optimizer.py initialises the state so before its save)."""
    from megatron.core import dist_checkpointing

    from mindspeed_like.testing import init_parallel

    init_parallel()
    model, optimizer = _build(True, distributed_optimizer)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner.init_state_fn(inner.optimizer)
    states = _inner_states(optimizer)
    assert states and all(float(s["step"]) == 0.0 for s in states), [sorted(s) for s in states]
    dist_checkpointing.save(_state(model, optimizer, loading=False), str(tmp_path))
    optimizer.step()  # torch's Adam steps on the states init_state_fn made


@OLD_DISTOPT_NEEDS_NUMPY_1
def test_a_distributed_optimizer_with_stepless_moments_saves(adaptor, tmp_path):
    """fix-distopt-checkpoint-without-apex: moments written in FusedAdam's layout (no step), as megatron's
    dist_checkpointing tests' setup_model_and_optimizer writes them, save with step 0 (KeyError: 'step'
    before); the running optimizer's state is left as it was."""
    from megatron.core import dist_checkpointing

    from mindspeed_like.testing import init_parallel

    init_parallel()
    model, optimizer = _build(False, True)
    inner = optimizer.optimizer
    for group in inner.param_groups:
        for param in group["params"]:
            inner.state[param]["exp_avg"] = torch.rand_like(param)
            inner.state[param]["exp_avg_sq"] = torch.rand_like(param)
    dist_checkpointing.save(_state(model, optimizer, loading=False), str(tmp_path))
    assert all(set(state) == {"exp_avg", "exp_avg_sq"} for state in inner.state.values())
