"""CPU adapter, megatron's ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``; 0.13-0.19).

The optimizer splits the parameters between a device optimizer and a host one: a share
(``offload_fraction``, by element count) of the parameters that live on the GPU gets a host copy
stepped by the CPU optimizer, and the copies go back to the GPU after each step. It tells the two
apart by ``param.is_cuda``. On a CPU host every parameter lives on the host, where training runs,
so none counts as a device parameter: every one lands in the CPU optimizer's groups without the
host copy that its gradient sync looks up, and the first ``step`` raises ``KeyError`` (Megatron-LM's
72 tests of it in ``test_optimizer_cpu_offloading.py`` fail so).

The adapter keeps megatron's split with "lives where training runs" in place of ``is_cuda``:

* ``_get_sub_optimizer_param_groups``: the parameters given are the device's; the first
  ``offload_fraction`` of their elements get a host copy (not pinned: a host has no pinned
  memory) stepped by the CPU optimizer, exactly as megatron selects them on a GPU;
* ``__init__``: ``pin_cpu_grads``/``pin_cpu_params`` off (``torch.empty(pin_memory=True)`` raises
  without an accelerator);
* ``_init_sub_optimizers``, ``step``, ``_register_param_copy_back_gpu_hook`` and
  ``_move_new_state_to_right_device`` run as host twins (``host_view``): their CUDA streams and
  events are the host's no-ops, their ``"cuda"`` the CPU.

The copies and the copy-back hooks still run, so the result is megatron's hybrid step on one
device: the same updates as the device optimizer alone (what megatron's tests check).
"""

from __future__ import annotations

import torch

from mindspeed_like.adapters.cpu.devices import on_host
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call

HDO = "optimizer.cpu_offloading.hybrid_optimizer.HybridDeviceOptimizer"


def _without_pinning(wrapped, instance, args, kwargs):
    return Call(wrapped, args, kwargs)(pin_cpu_grads=False, pin_cpu_params=False)


def _split_on_host(wrapped, instance, args, kwargs):
    """megatron's split (same order, same threshold), every given parameter a device parameter."""
    offload_fraction = Call(wrapped, args, kwargs)["offload_fraction"]
    params = [p for group in instance.param_groups for p in group["params"]]
    offload_threshold = sum(p.numel() for p in params) * offload_fraction
    offloaded_numel = 0
    cpu_groups, device_groups = [], []
    device_to_copy, copy_to_device, to_fp32 = {}, {}, {}
    for group in instance.param_groups:
        device_group, cpu_group = {**group, "params": []}, {**group, "params": []}
        for param in group["params"]:
            inner, copied = param, False
            if offloaded_numel < offload_threshold:
                inner = param.detach().clone()
                offloaded_numel += inner.numel()
                copied = True
            if instance.param_update_in_fp32 and inner.dtype != torch.float32:
                inner = inner.detach().clone().float()
                to_fp32[param] = inner
            if copied:
                device_to_copy[param] = inner
                copy_to_device[inner] = param
            (cpu_group if copied else device_group)["params"].append(inner)
        if device_group["params"]:
            device_groups.append(device_group)
        if cpu_group["params"]:
            cpu_groups.append(cpu_group)
    return cpu_groups, device_groups, device_to_copy, copy_to_device, to_fp32


PATCHES = [
    Patch(f"megatron.core.{HDO}.__init__", Kind.WRAP, _without_pinning, why="pin_memory=True raises without CUDA"),
    Patch(
        f"megatron.core.{HDO}._get_sub_optimizer_param_groups",
        Kind.WRAP,
        _split_on_host,
        why="splits by param.is_cuda: on a host no parameter is a device parameter (KeyError at step)",
    ),
    on_host(f"{HDO}._init_sub_optimizers", "torch.cuda.Stream()/current_stream() for its copies"),
    on_host(f"{HDO}.step", "waits on torch.cuda streams around the grad copies"),
    on_host(f"{HDO}._register_param_copy_back_gpu_hook", "copy-back hooks on torch.cuda streams"),
    on_host(f"{HDO}._move_new_state_to_right_device", "moves the device optimizer's state to 'cuda'"),
]
