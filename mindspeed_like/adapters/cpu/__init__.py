"""The cpu-adapter feature: megatron-core trains on a CPU-only host.

Switched on when the device resolves to cpu (``--device cpu``, or ``auto`` without an NPU or a
GPU). Its patches live in one module per area of megatron: ``rng``, ``norm``, ``devices``,
``optimizer``, ``moe``, ``schedules`` (pipeline parallelism), ``checkpointing``
(``dist_checkpointing``), ``ckpt_worker`` (the persistent async-save worker),
``context_parallel`` (the rotary embedding per CP rank),
``triton_kernels`` (megatron's Triton-only kernels, in torch operations) and ``hybrid_optimizer``
(``--optimizer-cpu-offload``'s optimizer on one device); each
module's docstring says why each target is the right one.
Almost all of them run megatron's own function bodies as host twins (``host_view``):
``torch.cuda`` seen as the CPU, ``'cuda'`` constants read ``'cpu'``, ``x.cuda()`` read
``x.cpu()``. Nothing in torch is changed: the feature makes no global change.
"""

from __future__ import annotations

from mindspeed_like.adapters.cpu import (
    checkpointing,
    ckpt_worker,
    context_parallel,
    devices,
    fsdp,
    hybrid_optimizer,
    moe,
    mtp,
    norm,
    optimizer,
    rng,
    schedules,
    triton_kernels,
    yarn,
)
from mindspeed_like.toolkit.declaration import Feature, on_device

NAME = "cpu-adapter"

FEATURE = Feature(
    name=NAME,
    summary="megatron-core runs and trains on a CPU-only host (CUDA calls adapted at megatron's call sites)",
    patches=[
        *rng.PATCHES,
        *norm.PATCHES,
        *devices.PATCHES,
        *fsdp.PATCHES,
        *optimizer.PATCHES,
        *moe.PATCHES,
        *schedules.PATCHES,
        *checkpointing.PATCHES,
        *ckpt_worker.PATCHES,
        *context_parallel.PATCHES,
        *yarn.PATCHES,
        *mtp.PATCHES,
        *triton_kernels.PATCHES,
        *hybrid_optimizer.PATCHES,
    ],
    enabled=on_device("cpu"),
    backend="cpu",
    switched_by="--device cpu (auto: no NPU, no CUDA)",
    kind="adapter",
)
