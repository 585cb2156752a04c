"""Runs for test_reuse_fp32_param_readers.py (module level: spawned gloo processes import them)."""

from __future__ import annotations

import reuse_fp32_workers as W
import torch


def _flat_masters(opt) -> list[torch.Tensor]:
    """What megatron's readers see as masters: each bf16 parameter's ``main_param`` (the Float16
    optimizer: every parameter; the DistributedOptimizer: this rank's shards, None elsewhere)."""
    params = [p for inner in W.inner_optimizers(opt) for g in inner.optimizer.param_groups for p in g["params"]]
    return [p.detach().clone().view(torch.int32) for p in params]


def masters_read_by_megatron(use_distributed_optimizer: bool) -> dict:
    """Masters as a reader sees them outside and inside ``readers.true_masters()``, the exact ones
    (the optimizer's own checkpoint path), and the bf16 weights before and after the reader."""
    from mindspeed_like.features.reuse_fp32_param import readers

    def after(model, opt):
        weights = W.weights_of(opt) or [p.detach().clone().view(torch.int16) for p in model.parameters()]
        outside = _flat_masters(opt)
        with readers.true_masters():
            inside = _flat_masters(opt)
        exact = W.masters_of(opt)
        if not exact:  # DistributedOptimizer: its checkpoint path materializes the shards
            from mindspeed_like.features.reuse_fp32_param.float16 import state_of

            states = [state_of(inner) for inner in W.inner_optimizers(opt)]
            assert all(states), "the feature set up every DistributedOptimizer"
            for state in states:
                state.materialize()
            exact = _flat_masters(opt)
            for state in states:
                state.to_split()
        weights_after = W.weights_of(opt) or [p.detach().clone().view(torch.int16) for p in model.parameters()]
        return dict(outside=outside, inside=inside, exact=exact, weights=weights, weights_after=weights_after)

    result = W.train(True, 3, after=after, use_distributed_optimizer=use_distributed_optimizer)
    return W.plain(result["after"])
