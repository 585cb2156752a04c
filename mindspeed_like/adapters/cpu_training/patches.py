"""cpu-training-loop patches: Megatron-LM's own training loop (megatron.training) on a CPU host.

megatron.training is not part of the megatron-core wheel; it exists in Megatron-LM checkouts,
so every target here is optional and waits for its module's import (``module=`` given). With
the cpu-adapter (megatron.core) these patches let ``pretrain_gpt.py`` train unmodified. The
research behind each one (what breaks, where, why) is summarized in docs/megatron-lm.md.

Targets and why each is the right one:
* ``torch`` as a module global of ``megatron.training.{initialize,training,utils,checkpointing}``
  and of ``megatron.core.{timers,rerun_state_machine}`` (the timers and the rerun state machine
  are core modules driven only by the training loop): these modules call ``torch.cuda.*`` and
  ``device='cuda'`` factories throughout; each gets its own host view of torch
  (``device/host_training.py``), and no other module is touched (``update_aliases=False``).
* ``initialize.initialize_megatron``: asserts ``torch.cuda.is_available()`` unless its own
  ``allow_no_cuda`` argument is set; we set that argument instead of faking CUDA.
* ``arguments.validate_args``: see ``arguments.py`` (a hook of the one validate_args wrap).
* ``initialize._warmup_jit_function``: draws ``torch.rand(device="cuda")`` warm-up tensors whose
  sizes depend on TP/SP; on a host the "cuda" generator is the CPU generator, so without
  isolation TP=1 and TP=2 would start from different weights. It runs under ``fork_rng``.
* ``megatron.legacy.fused_kernels.load``: looks for nvcc under CUDA_HOME (TypeError when unset);
  there are no CUDA kernels to build on a host, so it does nothing there.
* ``training.get_model``, ``training.evaluate``, ``utils.get_batch_on_this_tp_rank``: call
  ``.cuda()`` on modules and batches; they run inside a host region where ``.cuda()`` leaves
  the object on the CPU (the two global wraps below act only inside such a region).
"""

from __future__ import annotations

import logging

import torch

from mindspeed_like.adapters.cpu_training.host_training import TRAINING_HOST_TORCH, run_in_host_region, stay_on_host
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.targets import LEGACY_FUSED_KERNELS as FUSED_KERNELS
from mindspeed_like.toolkit.targets import TRAINING_CHECKPOINTING as CHECKPOINTING
from mindspeed_like.toolkit.targets import TRAINING_INITIALIZE as INITIALIZE
from mindspeed_like.toolkit.targets import TRAINING_LOOP as TRAINING
from mindspeed_like.toolkit.targets import TRAINING_UTILS as UTILS

logger = logging.getLogger("mindspeed_like")

HOST_VIEW_MODULES = (
    INITIALIZE,
    TRAINING,
    UTILS,
    CHECKPOINTING,
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
)


def _allow_no_cuda(wrapped, instance, args, kwargs):
    return Call(wrapped, args, kwargs)(allow_no_cuda=True)


def _isolated_rng(wrapped, instance, args, kwargs):
    with torch.random.fork_rng(devices=[]):
        return wrapped(*args, **kwargs)


def _no_fused_kernels(args) -> None:
    """megatron.legacy.fused_kernels.load on a host: there are no CUDA kernels to build."""
    logger.info("mindspeed_like: megatron.legacy.fused_kernels.load skipped (no CUDA kernels on a host)")


def _optional(target: str, kind: Kind, new, module: str, why: str, **extra) -> Patch:
    return Patch(target, kind, new, optional=True, module=module, why=why, **extra)


PATCHES = [
    *[
        _optional(
            f"{name}.torch",
            Kind.REPLACE,
            TRAINING_HOST_TORCH,
            name,
            "module-local host view of torch: torch.cuda.* and device='cuda' on the CPU",
            update_aliases=False,
        )
        for name in HOST_VIEW_MODULES
    ],
    _optional(
        f"{INITIALIZE}.initialize_megatron",
        Kind.WRAP,
        _allow_no_cuda,
        INITIALIZE,
        "allow_no_cuda=True instead of asserting torch.cuda.is_available()",
    ),
    _optional(
        f"{INITIALIZE}._warmup_jit_function",
        Kind.WRAP,
        _isolated_rng,
        INITIALIZE,
        "warm-up draws from the host generator would make initial weights depend on TP/SP",
    ),
    _optional(f"{FUSED_KERNELS}.load", Kind.REPLACE, _no_fused_kernels, FUSED_KERNELS, "no nvcc on a host"),
    *[
        _optional(f"{module}.{name}", Kind.WRAP, run_in_host_region, module, "calls .cuda() on modules/batches")
        for module, name in ((TRAINING, "get_model"), (TRAINING, "evaluate"), (UTILS, "get_batch_on_this_tp_rank"))
    ],
    Patch(
        "torch.Tensor.cuda",
        Kind.WRAP,
        stay_on_host,
        global_change=True,
        why="identity inside megatron.training's host regions only; unchanged elsewhere",
    ),
    Patch(
        "torch.nn.Module.cuda",
        Kind.WRAP,
        stay_on_host,
        global_change=True,
        why="identity inside megatron.training's host regions only; unchanged elsewhere",
    ),
]
