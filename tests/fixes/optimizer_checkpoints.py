"""A tiny megatron GPT with its megatron optimizer, and the sharded state megatron-core's
``dist_checkpointing`` saves and loads for it: the optimizer-checkpoint fixes' tests share them."""

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


def build_gpt_and_optimizer(fp16: bool, distributed_optimizer: bool):
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


def checkpoint_state(model, optimizer, loading: bool) -> dict:
    state = {"model": model.module.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading)
    return state


def inner_states(optimizer) -> list[dict]:
    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o.optimizer.state.get(p, {}) for o in optimizers for g in o.optimizer.param_groups for p in g["params"]]
