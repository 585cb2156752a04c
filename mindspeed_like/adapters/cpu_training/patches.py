"""cpu-training-loop patches: Megatron-LM's own training loop (megatron.training) on a CPU host.

megatron.training exists in Megatron-LM checkouts and, from megatron-core 0.17, in the wheel; so
every target here is optional and waits for its module's import (``module=`` given), and a
target missing from an imported module is a logged fallback (an error under --strict), not a
silent skip. With the cpu-adapter (megatron.core) these patches let ``pretrain_gpt.py`` train
unmodified. The research behind each one (what breaks, where, why) is summarized in
docs/megatron-lm.md.

Targets and why each is the right one:
* ``torch`` as a module global of ``megatron.training.{initialize,training,utils,checkpointing}``
  (``utils`` is a package from 0.18: its ``common_utils`` holds the old module's code) and of
  ``megatron.core.{timers,rerun_state_machine}`` (the timers and the rerun state machine
  are core modules driven only by the training loop): these modules call ``torch.cuda.*`` and
  ``device='cuda'`` factories throughout; each gets its own host view of torch
  (``device/host_training.py``), and no other module is touched (``update_aliases=False``).
* ``initialize.initialize_megatron``: asserts ``torch.cuda.is_available()`` unless its own
  ``allow_no_cuda`` argument is set; we set that argument instead of faking CUDA.
* ``arguments.validate_args``: see ``arguments.py`` (a hook of the one validate_args wrap).
* ``initialize._warmup_jit_function``: draws ``torch.rand(device="cuda")`` warm-up tensors whose
  sizes depend on TP/SP; on a host the "cuda" generator is the CPU generator, so without
  isolation TP=1 and TP=2 would start from different weights. It runs under ``fork_rng``.
* ``training.build_train_valid_test_data_iterators``: host work that draws from the host
  generator (each ``iter(DataLoader)`` draws its base seed). On a GPU dropout draws from the
  device generator, which host draws never move; on a CPU host the two are one generator. A
  resumed run builds its iterators after ``load_checkpoint`` restored the generator, the straight
  run before its first step, so every resume at megatron's default dropout continued a different
  run (issue 37 item 0). It runs under ``fork_rng``: the draws it makes are the same, the
  device stream after it is the one the checkpoint restored.
* ``megatron.legacy.fused_kernels.load``: looks for nvcc under CUDA_HOME (TypeError when unset);
  there are no CUDA kernels to build on a host, so it does nothing there.
* ``training.get_model``, ``training.evaluate``, ``utils.get_batch_on_this_tp_rank`` (<0.18):
  call ``.cuda()`` on modules and batches; they run inside a host region where ``.cuda()``
  leaves the object on the CPU (the two global wraps below act only inside such a region).
  From 0.18 the script's own ``get_batch`` moves the batch (``.cuda(non_blocking=True)``), so
  ``training.train_step`` is the region, and ``megatron.core.utils.get_batch_on_this_tp_rank``
  (moved there from megatron.training) runs as a host twin (``torch.cuda.current_device()``).
"""

from __future__ import annotations

import logging

import torch

from mindspeed_like.adapters.cpu.host_view import run_on_host
from mindspeed_like.adapters.cpu_training.host_training import TRAINING_HOST_TORCH, run_in_host_region, stay_on_host
from mindspeed_like.engine import Kind, Patch
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.declaration import Context
from mindspeed_like.toolkit.errors import FeatureUnsupported
from mindspeed_like.toolkit.targets import CORE_UTILS
from mindspeed_like.toolkit.targets import LEGACY_FUSED_KERNELS as FUSED_KERNELS
from mindspeed_like.toolkit.targets import TRAINING_CHECKPOINTING as CHECKPOINTING
from mindspeed_like.toolkit.targets import TRAINING_INITIALIZE as INITIALIZE
from mindspeed_like.toolkit.targets import TRAINING_LOOP as TRAINING
from mindspeed_like.toolkit.targets import TRAINING_UTILS as UTILS

logger = logging.getLogger("mindspeed_like")

HOST_VIEW_MODULES = (  # and megatron.training.utils (<0.18) / its common_utils (0.18+): see patches()
    INITIALIZE,
    TRAINING,
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


NAME = "cpu-training-loop"
LAYOUT_018 = ">=0.18"  # megatron.training.utils became a package; get_batch_on_this_tp_rank moved to core
UTILS_COMMON = f"{UTILS}.common_utils"


class CpuTrainingUnsupported(FeatureUnsupported):
    """``strict`` is on and a megatron.training target this release should have is missing."""


def patches(ctx: Context) -> list[Patch]:
    """Every target is optional (it exists only with Megatron-LM's training loop), but once its
    module is imported a missing attribute is a behaviour-changing skip: logged as a warning by
    the feature's fallback (an error under --strict), never a silent info line."""
    missing = ctx.fallback(NAME, CpuTrainingUnsupported, "a CUDA call of Megatron-LM's training loop stays unadapted")

    def optional(target: str, kind: Kind, new, module: str, why: str, **extra) -> Patch:
        return Patch(target, kind, new, optional=True, module=module, why=why, on_missing=missing, **extra)

    host_view = [(name, None) for name in HOST_VIEW_MODULES] + [(UTILS, "<0.18"), (UTILS_COMMON, LAYOUT_018)]
    return [
        *[
            optional(
                f"{name}.torch",
                Kind.REPLACE,
                TRAINING_HOST_TORCH,
                name,
                "module-local host view of torch: torch.cuda.* and device='cuda' on the CPU",
                update_aliases=False,
                versions=versions,
            )
            for name, versions in host_view
        ],
        optional(
            f"{INITIALIZE}.initialize_megatron",
            Kind.WRAP,
            _allow_no_cuda,
            INITIALIZE,
            "allow_no_cuda=True instead of asserting torch.cuda.is_available()",
        ),
        optional(
            f"{INITIALIZE}._warmup_jit_function",
            Kind.WRAP,
            _isolated_rng,
            INITIALIZE,
            "warm-up draws from the host generator would make initial weights depend on TP/SP",
        ),
        optional(
            f"{TRAINING}.build_train_valid_test_data_iterators",
            Kind.WRAP,
            _isolated_rng,
            TRAINING,
            "host draws (DataLoader base seeds) would move the dropout stream a resumed run restored",
        ),
        # megatron.legacy is in Megatron-LM checkouts only (not in the wheel): a plain optional skip
        Patch(
            f"{FUSED_KERNELS}.load",
            Kind.REPLACE,
            _no_fused_kernels,
            optional=True,
            module=FUSED_KERNELS,
            why="no nvcc on a host",
        ),
        *[
            optional(f"{TRAINING}.{name}", Kind.WRAP, run_in_host_region, TRAINING, "calls .cuda() on modules/batches")
            for name in ("get_model", "evaluate")
        ],
        optional(
            f"{UTILS}.get_batch_on_this_tp_rank",
            Kind.WRAP,
            run_in_host_region,
            UTILS,
            "calls .cuda() on batches",
            versions="<0.18",
        ),
        # 0.18+: the batch loader of pretrain_gpt.py moves the batch with .cuda() itself (script
        # code, no target), inside megatron's train_step; the broadcast moved to megatron.core.utils
        # and allocates on torch.cuda.current_device() (a host twin: megatron.core.utils is shared).
        optional(
            f"{TRAINING}.train_step",
            Kind.WRAP,
            run_in_host_region,
            TRAINING,
            "the script's get_batch calls .cuda() on batches inside train_step",
            versions=LAYOUT_018,
        ),
        Patch(
            f"{CORE_UTILS}.get_batch_on_this_tp_rank",
            Kind.WRAP,
            run_on_host,
            versions=LAYOUT_018,
            why="broadcast buffers on torch.cuda.current_device()",
        ),
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
