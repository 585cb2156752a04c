"""The cpu-adapter feature: megatron-core trains on a CPU-only host.

Switched on when the device resolves to cpu (``--device cpu``, or ``auto`` without an NPU or
a GPU). It gathers the patches of ``cpu_rng``, ``cpu_norm``, ``cpu_devices``,
``cpu_optimizer``, ``cpu_moe``, ``cpu_schedules`` (pipeline parallelism) and ``cpu_checkpointing``
(``dist_checkpointing``); each module's docstring says why each target is the right one.
Almost all of them run megatron's own function bodies as host twins
(``mindspeed_like.device.host_view``): ``torch.cuda`` seen as the CPU, ``'cuda'`` constants read
``'cpu'``, ``x.cuda()`` read ``x.cpu()``. Nothing in torch is changed: the feature makes no global change.
"""

from __future__ import annotations

from mindspeed_like.config import Config
from mindspeed_like.features.base import Feature, on_device
from mindspeed_like.megatron_version import megatron_core_version
from mindspeed_like.patches import (
    cpu_checkpointing,
    cpu_devices,
    cpu_moe,
    cpu_norm,
    cpu_optimizer,
    cpu_rng,
    cpu_schedules,
)
from mindspeed_like.patching import Patch

PATCHES = [
    *cpu_rng.PATCHES,
    *cpu_norm.PATCHES,
    *cpu_devices.PATCHES,
    *cpu_optimizer.PATCHES,
    *cpu_moe.PATCHES,
    *cpu_schedules.PATCHES,
    *cpu_checkpointing.PATCHES,
]


def patches_for_installed_megatron(config: Config) -> list[Patch]:
    """PATCHES plus the targets that moved between versions, for the megatron-core that
    ``import megatron.core`` finds now (a Megatron-LM checkout put on sys.path after our import
    is seen when the feature is applied again, e.g. by Megatron-LM's parse_args)."""
    version = megatron_core_version()
    return [*PATCHES, *cpu_devices.versioned_patches(version), *cpu_schedules.versioned_patches(version)]


FEATURE = Feature(
    name="cpu-adapter",
    summary="megatron-core runs and trains on a CPU-only host (CUDA calls adapted at megatron's call sites)",
    patches=patches_for_installed_megatron,
    enabled=on_device("cpu"),
    backend=lambda config: "cpu",
    switched_by="--device cpu (auto: no NPU, no CUDA)",
)
