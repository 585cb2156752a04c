"""megatron's optimizer on torch's AdamW (no TE, no apex) with ``OptimizerConfig``'s default
``lr=None``: TypeError from torch's constructor without the fix; with it the optimizer builds, its
groups' lr stay None until the scheduler sets them (a step before that still fails), and the
training then equals a run built with the rate given."""

from __future__ import annotations

import megatron.core.optimizer  # noqa: F401  (the skip condition reads which optimizers it took)
import pytest
import torch

from mindspeed_like import runtime
from mindspeed_like.fixes import torch_optimizer_lr_none as fix
from mindspeed_like.testing import destroy_parallel, init_parallel, tiny_gpt


def _optimizer(lr: float | None, use_distributed_optimizer: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = tiny_gpt(bf16=True)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer), model
    )
    config = OptimizerConfig(optimizer="adam", bf16=True, lr=lr, use_distributed_optimizer=use_distributed_optimizer)
    return ddp, get_megatron_optimizer(config, [ddp]), config


def _step(ddp, optimizer) -> float:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    optimizer.step()
    return float(loss)


@pytest.mark.skipif(not fix._builds_torch_optimizer(), reason="megatron-core took TE's or apex's optimizer here")
@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["float16", "distributed"])
def test_lr_none_builds_and_the_scheduler_sets_the_rate(adaptor, use_distributed_optimizer):
    init_parallel(seed=3)
    try:
        runtime.ENGINE.remove(fix.FEATURE.name)  # megatron's own behaviour
        with pytest.raises(TypeError, match="NoneType"):
            _optimizer(None, use_distributed_optimizer)
        runtime.ENGINE.apply(fix.FEATURE.name, fix.PATCHES)
    finally:
        destroy_parallel()
    init_parallel(seed=3)
    try:
        ddp, optimizer, config = _optimizer(None, use_distributed_optimizer)
        assert config.lr is None
        groups = [g for o in fix._torch_optimizers(optimizer) for g in o.param_groups]
        assert groups and all(g["lr"] is None for g in groups)
        with pytest.raises(TypeError):  # no placeholder rate: a step before the scheduler fails loudly
            _step(ddp, optimizer)
    finally:
        destroy_parallel()
    init_parallel(seed=3)
    try:  # a fresh one (the failed step advanced Adam's step count), its rate set as the scheduler does
        ddp, optimizer, _ = _optimizer(None, use_distributed_optimizer)
        groups = [g for o in fix._torch_optimizers(optimizer) for g in o.param_groups]
        for group in groups:
            group["lr"] = 1e-3  # what OptimizerParamScheduler.step does
        ours = [_step(ddp, optimizer) for _ in range(3)]
    finally:
        destroy_parallel()
    init_parallel(seed=3)
    try:
        ddp, optimizer, _ = _optimizer(1e-3, use_distributed_optimizer)
        theirs = [_step(ddp, optimizer) for _ in range(3)]
    finally:
        destroy_parallel()
    assert ours == theirs
