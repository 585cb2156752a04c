"""megatron's HybridDeviceOptimizer (``--optimizer-cpu-offload``) on a CPU host. Without the cpu
adapter it cannot be built (CUDA streams); with only the streams adapted its first step raised
KeyError (no parameter is ``is_cuda``, so none got its host copy: Megatron-LM's own tests). With
the adapter: megatron's split on one device, and the parameters after the steps are the reference
optimizer's, offloaded share 0, half or all (what test_optimizer_cpu_offloading.py checks on a GPU)."""

from __future__ import annotations

import pytest
import torch

import mindspeed_like
from mindspeed_like import runtime


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train(optimizer, net, steps: int) -> None:
    data = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        optimizer.zero_grad()
        net(data).square().mean().backward()
        optimizer.step()


@pytest.fixture
def on_cpu():
    mindspeed_like.reset()
    mindspeed_like.configure(device="cpu")
    yield
    mindspeed_like.reset()


@pytest.mark.parametrize("offload_fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_hybrid_steps_equal_the_reference_optimizer(on_cpu, offload_fraction, overlap):
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    net, reference = _net(), _net()
    hybrid = HybridDeviceOptimizer(
        net.parameters(),
        offload_fraction=offload_fraction,
        lr=1e-2,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        overlap_cpu_optimizer_d2h_h2d=overlap,
    )
    offloaded = sum(p.numel() for p in hybrid.gpu_params_map_cpu_copy)
    total = sum(p.numel() for p in net.parameters())
    assert (offloaded == 0) == (offload_fraction == 0) and (offloaded == total) == (offload_fraction == 1.0)
    _train(hybrid, net, 5)
    _train(torch.optim.AdamW(reference.parameters(), lr=1e-2), reference, 5)
    for ours, theirs in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert len(hybrid.state_dict()["state"]) == len(list(net.parameters()))


def test_without_the_adapter_it_cannot_be_built(on_cpu):
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    runtime.ENGINE.remove("cpu-adapter")  # megatron's own code on this host: CUDA streams at construction
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        hybrid_optimizer.HybridDeviceOptimizer(
            _net().parameters(),
            offload_fraction=0.5,
            lr=1e-2,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.AdamW,
            pin_cpu_grads=False,
            pin_cpu_params=False,
            overlap_cpu_optimizer_d2h_h2d=False,
        )
