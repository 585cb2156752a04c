"""A host twin reads megatron's ``x.cuda(...)`` as ``x.to(...)`` with the same arguments (issue 37 item 1).

It read ``x.cpu()`` before, whose empty signature refused ``DynamicGradScaler.load_state_dict``'s
``state_dict['scale'].cuda(torch.cuda.current_device())``: every ``--fp16`` resume died there.
"""

from __future__ import annotations

import torch

from mindspeed_like.adapters.cpu.host_view import host_function


def _moves(x, how):
    if how == "device":
        return x.cuda(torch.cuda.current_device())
    if how == "non_blocking":
        return x.cuda(non_blocking=True)
    if how == "keyword":
        return x.cuda(device=torch.cuda.current_device())
    return x.cuda()


def test_cuda_calls_with_their_arguments_stay_on_the_host():
    twin = host_function(_moves)
    tensor, module = torch.ones(3), torch.nn.Linear(2, 2)
    for how in ("device", "non_blocking", "keyword", "none"):
        assert twin(tensor, how) is tensor
        assert twin(module, how) is module


def test_dynamic_grad_scaler_state_round_trips_on_the_host(adapter):
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    def scaler():
        return DynamicGradScaler(
            2.0**16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2, hysteresis=2
        )

    saved = scaler()
    saved.update(found_inf=False)
    saved.update(found_inf=False)  # grows after growth_interval good steps
    saved.update(found_inf=True)  # one hysteresis step used
    loaded = scaler()
    loaded.load_state_dict(saved.state_dict())
    assert loaded.scale.device.type == "cpu" and loaded.scale.item() == saved.scale.item() == 2.0**17
    assert loaded.state_dict()["growth_tracker"] == saved.state_dict()["growth_tracker"]
    assert loaded.state_dict()["hysteresis_tracker"] == saved.state_dict()["hysteresis_tracker"] == 1
