"""compare's optimizer meter counts every tensor the optimizer keeps alive, found from the objects
(issue 49 item 4: reuse-fp32-param's int16 residual shard, held under the feature's own attribute of
megatron's DistributedOptimizer, was outside a list of attribute names, and compare reported the
features arm's model state 11.5 MB a rank short of what it holds)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindspeed_like.compare.measure import state_bytes


@dataclass
class _Shard:
    """A feature's own state, as reuse-fp32-param's ``BucketShard`` keeps it (a dataclass)."""

    residual: torch.Tensor


class _Slotted:
    __slots__ = ("flag",)

    def __init__(self, flag: torch.Tensor) -> None:
        self.flag = flag


class _Megatron:
    """The shape of megatron's optimizer: an inner torch optimizer, master groups, the model chunks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.masters = [p.detach().float().clone() for p in model.parameters()]
        self.optimizer = torch.optim.Adam(self.masters)
        self.model_chunks = [model]
        self.found_inf = torch.zeros(1)


def test_every_tensor_the_optimizer_and_its_features_hold_is_counted() -> None:
    model = torch.nn.Linear(8, 4, bias=False).to(torch.bfloat16)
    model.register_buffer("not_optimizer_state", torch.zeros(1000))  # the model's: never the optimizer's
    optimizer = _Megatron(model)
    for master in optimizer.masters:
        master.grad = torch.ones_like(master)
    optimizer.optimizer.step()
    masters_and_moments = 3 * 32 * 4 + 4 + 4  # fp32 masters, exp_avg, exp_avg_sq; step; found_inf
    assert state_bytes(model, optimizer)["optimizer"] == masters_and_moments

    optimizer._a_feature_s_state = {"shards": [_Shard(torch.zeros(32, dtype=torch.int16))]}  # any name
    optimizer.masters[0].side = _Slotted(torch.zeros(3, dtype=torch.uint8))  # on a tensor, in __slots__
    measured = state_bytes(model, optimizer)
    assert measured["optimizer"] == masters_and_moments + 64 + 3
    assert measured["weights"] == 32 * 2  # a storage is counted once, under the first kind that holds it
