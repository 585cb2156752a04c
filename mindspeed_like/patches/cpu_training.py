"""The cpu-training-loop feature: Megatron-LM's own training loop (megatron.training) on a CPU host.

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
* ``arguments.validate_args``: Megatron's defaults assume CUDA extensions (TransformerEngine
  layers, NCCL, apex/TE fusions); where the extension is absent the default is switched to the
  portable choice before validation, each change logged once. Both ``arguments`` and the
  by-name copy in ``initialize`` are covered (alias update).
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

import importlib.util
import inspect
import logging
import os

import torch

from mindspeed_like.device.host_training import TRAINING_HOST_TORCH, run_in_host_region, stay_on_host
from mindspeed_like.features.base import Feature, on_device
from mindspeed_like.patching import Kind, Patch

logger = logging.getLogger("mindspeed_like")

INITIALIZE = "megatron.training.initialize"
TRAINING = "megatron.training.training"
UTILS = "megatron.training.utils"
CHECKPOINTING = "megatron.training.checkpointing"
ARGUMENTS = "megatron.training.arguments"
FUSED_KERNELS = "megatron.legacy.fused_kernels"
HOST_VIEW_MODULES = (
    INITIALIZE,
    TRAINING,
    UTILS,
    CHECKPOINTING,
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
)


def _allow_no_cuda(wrapped, instance, args, kwargs):
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    bound.arguments["allow_no_cuda"] = True
    return wrapped(*bound.args, **bound.kwargs)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def host_defaults(args) -> list[str]:
    """Switch Megatron-LM defaults that need CUDA-only extensions to their portable choices.

    Returns what was changed, one line each (also logged). Called on Megatron's parsed args
    before ``validate_args`` derives anything from them.
    """
    changes = []

    def change(name: str, value, why: str) -> None:
        if hasattr(args, name) and getattr(args, name) != value:
            changes.append(f"args.{name}: {getattr(args, name)!r} -> {value!r} ({why})")
            setattr(args, name, value)

    have_te = _installed("transformer_engine")
    if getattr(args, "transformer_impl", None) == "transformer_engine" and not have_te:
        change("transformer_impl", "local", "TransformerEngine is not installed")
    if getattr(args, "distributed_backend", None) == "nccl" and not torch.distributed.is_nccl_available():
        change("distributed_backend", "gloo", "this torch has no NCCL")
    if not have_te:
        change("apply_rope_fusion", False, "the fused RoPE kernel needs TransformerEngine")
    if not _installed("fused_weight_gradient_mlp_cuda"):
        change("gradient_accumulation_fusion", False, "needs apex's fused_weight_gradient_mlp_cuda")
    if not _installed("scaled_masked_softmax_cuda"):
        change("masked_softmax_fusion", False, "needs the scaled_masked_softmax_cuda extension")
    if not _installed("apex"):
        change("no_persist_layer_norm", True, "persistent LayerNorm needs apex")
    parallel = getattr(args, "tensor_model_parallel_size", 1) > 1 or getattr(args, "context_parallel_size", 1) > 1
    if parallel and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        # Megatron asserts this for TP/CP on GPUs (kernel ordering across streams). A host runs
        # in program order, which is what the setting asks for; set it so the check passes.
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        changes.append("CUDA_DEVICE_MAX_CONNECTIONS=1 (host work runs in program order already)")
    if changes and getattr(args, "rank", 0) == 0:
        logger.warning("mindspeed_like cpu-training-loop adjusted Megatron-LM arguments:\n  %s", "\n  ".join(changes))
    return changes


def _validate_args_on_host(wrapped, instance, args, kwargs):
    host_defaults(args[0] if args else kwargs["args"])
    return wrapped(*args, **kwargs)


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
        f"{ARGUMENTS}.validate_args",
        Kind.WRAP,
        _validate_args_on_host,
        ARGUMENTS,
        "defaults needing TE/apex/NCCL switched to portable choices, each logged",
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


FEATURE = Feature(
    name="cpu-training-loop",
    summary="Megatron-LM's megatron.training loop (pretrain_gpt.py) runs on a CPU-only host",
    patches=PATCHES,
    requires=("cpu-adapter",),
    enabled=on_device("cpu"),
    backend=lambda config: "cpu",
    switched_by="--device cpu (auto: no NPU, no CUDA)",
)
