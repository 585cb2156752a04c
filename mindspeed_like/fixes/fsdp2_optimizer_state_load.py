"""Fix: a ``--use-torch-fsdp2`` optimizer loaded from a distributed checkpoint steps wrongly.

With torch FSDP2 every parameter is a ``DTensor`` and so is each of its optimizer states (Adam's
``exp_avg`` / ``exp_avg_sq``). megatron's ``sharded_state_dict`` saves each state's LOCAL shard
(``make_sharded_optimizer_tensor`` takes ``to_local_if_dtensor``), and a load hands those plain local
tensors to ``torch.optim.Optimizer.load_state_dict``, which keeps a value's type: the optimizer then
holds plain tensors beside ``DTensor`` parameters. torch's single-tensor Adam refuses the mix at the
first step ("aten.lerp_.Scalar got mixed torch.Tensor and DTensor"); through Megatron-LM's
``pretrain_gpt.py --use-torch-fsdp2 --ckpt-format torch_dist`` the run went on and the iterations
after ``--load`` left the uninterrupted run's from the second one (lm loss 5.685097 vs 5.713458 at
iteration 5 of a run saved at 3, 2 gloo ranks), on every device.

The fix: after megatron's ``load_state_dict`` of the non-distributed optimizers (the only ones FSDP2
takes), every plain state tensor of a ``DTensor`` parameter with that parameter's local shape becomes
a ``DTensor`` again, on the parameter's mesh and placements (``DTensor.from_local``: no copy, no
communication). The values are the loaded ones, untouched; nothing changes without DTensors.
"""

from __future__ import annotations

import torch

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.declaration import Feature, always_on
from mindspeed_like.toolkit.dtensors import dtensor_type

NAME = "fix-fsdp2-optimizer-state-load"
OPTIMIZER = "megatron.core.optimizer.optimizer"


def states_as_dtensors(optimizer: torch.optim.Optimizer) -> int:
    """Re-wrap plain state tensors of ``DTensor`` parameters as ``DTensor``s; returns how many."""
    dtensor = dtensor_type()
    if dtensor is None:
        return 0
    rewrapped = 0
    for param, state in optimizer.state.items():
        if not isinstance(param, dtensor):
            continue
        local_shape = param._local_tensor.shape
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, dtensor) and value.shape == local_shape:
                if value.dim() == 0 and param.dim() != 0:  # a scalar (e.g. Adam's step) is no shard
                    continue
                state[key] = dtensor.from_local(
                    value,
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
                rewrapped += 1
    return rewrapped


def load_then_rewrap(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    inner = getattr(instance, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        states_as_dtensors(inner)
    return result


PATCHES = [
    Patch(
        f"{OPTIMIZER}.{owner}.load_state_dict",
        Kind.WRAP,
        load_then_rewrap,
        # innermost: states are DTensors again before reuse-fp32-param re-splits the loaded masters
        before=("reuse-fp32-param",),
        why="a checkpoint's optimizer states are local shards; FSDP2's parameters are DTensors",
    )
    for owner in ("FP32Optimizer", "Float16OptimizerWithFloat16Params")
]

FEATURE = Feature(
    name=NAME,
    summary="--use-torch-fsdp2 resumes exactly: optimizer states loaded from a distributed checkpoint are DTensors "
    "like their parameters again (were plain local shards: a TypeError, or a silently different step)",
    patches=PATCHES,
    enabled=always_on,
    backend="any",
    kind="fix",
)
