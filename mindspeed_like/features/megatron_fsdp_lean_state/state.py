"""The wrappers of megatron-fsdp-lean-state, and why each target is the right one.

Megatron-FSDP's buffers come in four layouts, each served by its own patches (``LAYOUTS`` in
``__init__``): megatron-core 0.16 (below), 0.17, 0.18 and 0.19 (after it). Releases with a Megatron-FSDP
but no layout served (0.13-0.15, :class:`NoLayout`) say so once when a wrapper is built.

megatron-core 0.16.1:

* ``mcore_fsdp_adapter.FullyShardedDataParallel.__init__``: where Megatron-FSDP's buffers are sized
  from the ``DistributedDataParallelConfig``. For a bf16 model (``config.bf16``) with a sharding
  strategy other than ``no_shard`` the wrapper is built from a copy of that config with
  ``preserve_fp32_weights=False`` (no main-weight buffer: ``ParamAndGradBuffer`` then registers the
  bf16 weight shard as the optimizer's parameter) and ``grad_reduce_in_fp32=False`` (the gradient
  buffer in the parameters' dtype). A copy, not the caller's object: megatron compares every chunk's
  config with the optimizer's, and each chunk built here gets an equal one. The wrapper is marked, so
  the optimizer built over it is the one that keeps the masters.
* ``optimizer.get_megatron_optimizer``: over marked chunks the ``OptimizerConfig`` is megatron's
  precision-aware optimizer (``use_precision_aware_optimizer=True``, ``main_grads_dtype`` and both
  moments bf16 unless the caller asked for its own state dtypes, ``store_param_remainders``): the
  Adam then keeps each fp32 master as the bf16 shard plus an int16 remainder. Any other optimizer
  would step bf16 weights without masters: refused here, where the choice is made. Two links
  megatron-core 0.16.1 leaves out of that path (its Megatron-FSDP and precision-aware code never
  met) are made here:

  - ``ParamAndGradBuffer.update_main_grads`` hands the optimizer ``.decoupled_grad`` only when the
    buffer's ``use_precision_aware_optimizer`` attribute is set, and nothing in megatron-core sets it:
    without it the gradients land on ``.grad`` and a precision-aware Adam, which reads
    ``.decoupled_grad``, never updates a weight;
  - ``MegatronOptimizer.get_main_grads_for_grad_norm`` reads a Megatron-FSDP parameter's ``.grad``
    before it looks at ``.decoupled_grad``: the grad norm is 0 and clipping never acts. This
    optimizer's ``get_main_grads_for_grad_norm`` (wrapped: only optimizers built here) reads the
    decoupled gradients' local shards instead, with megatron's own filters.

megatron-core 0.17.1 sizes the buffers from a ``MixedPrecisionPolicy`` of
``megatron_fsdp_main_params_dtype`` and ``megatron_fsdp_main_grads_dtype``, but ``grad_reduce_in_fp32=True``
still overrides the gradient dtypes to fp32 (``mcore_fsdp_adapter``: "Grandfathered Argument"), and its
``update_main_grads`` and grad norm are 0.16's: the wrapper's copy sets the two dtype fields and
``grad_reduce_in_fp32=False`` (:data:`LEAN_DDP_MAIN_PARAMS_DTYPE`), and both links are made here as on 0.16.

megatron-core 0.18.2 has 0.19's ``megatron_fsdp_use_decoupled_grad`` option, its grad norm and its
``master_weights`` override (below), with ``grad_reduce_in_fp32`` still grandfathered as on 0.17
(:data:`LEAN_DDP_DECOUPLED_GRAD`).

megatron-core 0.19.2 reworked the buffers around a ``MixedPrecisionPolicy`` read from three
``DistributedDataParallelConfig`` fields, and wired Megatron-FSDP to the precision-aware optimizer
itself. Megatron's own options now do the buffer side and both links, so the wrappers only set them:

* ``FullyShardedDataParallel.__init__`` (same target): the copy of the config carries
  ``megatron_fsdp_main_params_dtype=None`` (no main-weight buffer: ``_init_distributed_params``
  registers the bf16 weight shard as the optimizer's parameter; ``preserve_fp32_weights`` is gone),
  ``megatron_fsdp_main_grads_dtype=bfloat16`` (the gradient buffer; 0.19's default None already means
  the parameters' dtype, ``grad_reduce_in_fp32`` is not read by Megatron-FSDP any more) and
  ``megatron_fsdp_use_decoupled_grad=True`` (``update_main_grads`` hands the gradients over as
  ``.decoupled_grad``: 0.16's missing buffer link, now megatron's option).
* ``get_megatron_optimizer`` (same target, same precision-aware ``OptimizerConfig``). The grad norm
  needs no wrapper: 0.19's ``_filter_grads_for_norm`` reads ``.decoupled_grad`` of a Megatron-FSDP
  parameter under the precision-aware optimizer. What stays ours is that the Adam keeps the masters:
  over Megatron-FSDP, 0.19 turns TE FusedAdam's ``master_weights`` off after building it (its masters
  are Megatron-FSDP's fp32 main-weight buffer there); without that buffer the Adam's remainders are
  the masters, so for optimizers built here ``master_weights`` is set back where megatron cleared it
  (TE's FusedAdam, and our Adam standing in for it without TE: precision-aware-optimizer clears it the way
  megatron clears TE's, ``_as_over_megatron_fsdp``).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.fallback import Fallback

FSDP_INIT = "megatron.core.distributed.fsdp.mcore_fsdp_adapter.FullyShardedDataParallel.__init__"
CUSTOM_FSDP_INIT = "megatron.core.distributed.custom_fsdp.FullyShardedDataParallel.__init__"
"""Megatron-FSDP's home in megatron-core 0.13 (``--use-custom-fsdp``): no layout served (:class:`NoLayout`)."""
GET_OPTIMIZER = "megatron.core.optimizer.get_megatron_optimizer"
GRADS_FOR_NORM = "megatron.core.optimizer.optimizer.MegatronOptimizer.get_main_grads_for_grad_norm"
MARK = "_mindspeed_lean_state"
"""Set on a FullyShardedDataParallel built with the lean buffers (its optimizer must keep the masters)."""

LEAN_DDP = (("preserve_fp32_weights", False), ("grad_reduce_in_fp32", False))
"""megatron-core 0.16's fields: no main-weight buffer, gradient buffers in the parameters' dtype."""
LEAN_DDP_MAIN_PARAMS_DTYPE = (
    ("megatron_fsdp_main_params_dtype", None),
    ("megatron_fsdp_main_grads_dtype", torch.bfloat16),
    ("grad_reduce_in_fp32", False),
)
"""megatron-core 0.17's fields: its MixedPrecisionPolicy is built from the first two, and
``grad_reduce_in_fp32=True`` (Megatron-LM's default for bf16) still overrides both gradient dtypes to
fp32 there ("grandfathered" in ``mcore_fsdp_adapter``), so it is switched off too. The buffer link is
still 0.16's attribute (``LeanOptimizer.link_buffer``)."""
LEAN_DDP_DECOUPLED_GRAD = (*LEAN_DDP_MAIN_PARAMS_DTYPE, ("megatron_fsdp_use_decoupled_grad", True))
"""megatron-core 0.18's fields: 0.17's (``grad_reduce_in_fp32`` still grandfathered) and the buffer link
as megatron's option, as on 0.19."""
LEAN_DDP_MIXED_PRECISION = (
    ("megatron_fsdp_main_params_dtype", None),
    ("megatron_fsdp_main_grads_dtype", torch.bfloat16),
    ("megatron_fsdp_use_decoupled_grad", True),
)
"""megatron-core 0.19's fields (its MixedPrecisionPolicy): no main-weight buffer, bf16 gradient
buffers, gradients handed to the optimizer as ``.decoupled_grad`` (0.19 no longer reads
``grad_reduce_in_fp32`` for Megatron-FSDP)."""
LEAN_OPTIMIZER = {
    "use_precision_aware_optimizer": True,
    "main_grads_dtype": torch.bfloat16,
    "exp_avg_dtype": torch.bfloat16,
    "exp_avg_sq_dtype": torch.bfloat16,
    "store_param_remainders": True,
}


def unsupported_reason(config, ddp_config) -> str | None:
    """Why this wrapper keeps Megatron-FSDP's own buffers (None: the lean ones apply)."""
    if not getattr(ddp_config, "use_megatron_fsdp", False):
        return None  # not Megatron-FSDP: nothing to say
    return _run_reason(config, ddp_config)


def _run_reason(config, ddp_config) -> str | None:
    """Why this run's settings keep Megatron-FSDP's own buffers on any release (None: none)."""
    if not getattr(config, "bf16", False):
        return "not a bf16 model (the masters are the bf16 weights plus a remainder)"
    if getattr(ddp_config, "data_parallel_sharding_strategy", "no_shard") == "no_shard":
        return "data_parallel_sharding_strategy no_shard (no sharded buffers)"
    if getattr(config, "fp8", None) or getattr(ddp_config, "fp8_param_gather", False):
        return "fp8 parameters (their masters are the main-weight buffer)"
    return None


@dataclass(frozen=True)
class LeanBuffers:
    """Wrapper of ``FullyShardedDataParallel.__init__``: lean buffers for a bf16 model.

    changes: the ``DistributedDataParallelConfig`` fields that make them on this release
    (:data:`LEAN_DDP`, :data:`LEAN_DDP_MAIN_PARAMS_DTYPE`, :data:`LEAN_DDP_DECOUPLED_GRAD` or
    :data:`LEAN_DDP_MIXED_PRECISION`)."""

    fall_back: Fallback
    changes: tuple[tuple[str, object], ...] = LEAN_DDP

    def __call__(self, wrapped, instance, args, kwargs):
        call = Call(wrapped, args, kwargs)
        config, ddp_config = call["config"], call["ddp_config"]
        if not getattr(ddp_config, "use_megatron_fsdp", False):
            return wrapped(*args, **kwargs)
        reason = unsupported_reason(config, ddp_config)
        if reason is not None:
            self.fall_back(reason)
            return wrapped(*args, **kwargs)
        result = call(ddp_config=dataclasses.replace(ddp_config, **dict(self.changes)))
        setattr(instance, MARK, True)
        return result


NO_LAYOUT_CUSTOM_FSDP = (
    "megatron-core {release}'s Megatron-FSDP (custom_fsdp, --use-custom-fsdp) has no lean layout: not run here "
    "(custom_fsdp does not run on a CPU host); the layouts served are megatron-core 0.16 to 0.19's"
)
NO_LAYOUT_NOT_RUN = (
    "megatron-core {release}'s Megatron-FSDP has no lean layout: its buffers read as 0.16's, but it was not run "
    "here (it does not build with torch 2.13); the layouts served are megatron-core 0.16 to 0.19's"
)
"""The lines of the releases without a layout (``__init__.NO_LAYOUT``): 0.13, 0.14 and 0.15."""


@dataclass(frozen=True)
class NoLayout:
    """Wrapper of Megatron-FSDP's constructor on a release without a lean layout (megatron-core 0.13's
    ``custom_fsdp.FullyShardedDataParallel``, 0.14's and 0.15's ``mcore_fsdp_adapter`` one): a wrapper
    built with the feature on says so, once, through the fallback (an error under ``--strict``) and keeps
    megatron's buffers, instead of leaving a user who asked for the feature at megatron's 18/DP bytes a
    parameter in silence. Said when a wrapper is built, not at import: a run without Megatron-FSDP hears
    nothing. A run the lean layout would refuse on any release (not bf16, ``no_shard``, fp8) hears that
    reason instead, as on 0.16+.

    Why no layout: 0.13's buffers have 0.16's knob (``preserve_fp32_weights``; without the main-weight
    buffer its ``update_main_grads`` hands the gradients over as ``.decoupled_grad``), and 0.14.0's and
    0.15.3's are 0.16.1's but for one line (the cast in ``update_main_grads`` under a main-weight buffer,
    absent from the lean layout), but none of them was run here: custom_fsdp is not adapted to a CPU host
    (``adapters/cpu/not_adapted.py``), and 0.14/0.15's Megatron-FSDP stops in its mesh code on torch 2.13
    (``_MeshEnv.child_to_root_mapping``), megatron's own arm included. We never apply what was not run."""

    fall_back: Fallback
    line: str

    def __call__(self, wrapped, instance, args, kwargs):
        call = Call(wrapped, args, kwargs)
        self.fall_back(_run_reason(call["config"], call["ddp_config"]) or self.line)
        return wrapped(*args, **kwargs)


def _chunks(model_chunks) -> list:
    return list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]


def lean_config(config):
    """``config`` as megatron's precision-aware optimizer with remainder masters; the caller's own
    state dtypes are kept when it asked for the precision-aware optimizer itself."""
    if getattr(config, "optimizer", "adam") != "adam":
        raise ConfigError(
            f"megatron-fsdp-lean-state keeps the fp32 masters in the precision-aware Adam; optimizer "
            f"{config.optimizer!r} would step the bf16 weight shards without them. Use --optimizer adam, or "
            "switch the feature off (--no-megatron-fsdp-lean-state)."
        )
    changes = dict(LEAN_OPTIMIZER)
    if getattr(config, "use_precision_aware_optimizer", False):
        changes = {"store_param_remainders": True}
    if getattr(config, "main_params_dtype", torch.float32) != torch.float32:
        raise ConfigError("megatron-fsdp-lean-state keeps fp32 masters (as remainders): --main-params-dtype fp32")
    return dataclasses.replace(config, **changes)


_LEAN_OPTIMIZERS: weakref.WeakSet = weakref.WeakSet()


@dataclass(frozen=True)
class LeanOptimizer:
    """Wrapper of ``get_megatron_optimizer``: the precision-aware optimizer over lean chunks.

    link_buffer: set the buffer's ``use_precision_aware_optimizer`` (megatron-core 0.16 and 0.17, where nothing
    else does; 0.18's and 0.19's buffer reads ``megatron_fsdp_use_decoupled_grad`` from its config).
    keep_masters: give the Adam back the ``master_weights`` megatron clears over Megatron-FSDP (0.18, 0.19)."""

    link_buffer: bool = True
    keep_masters: bool = False

    def __call__(self, wrapped, instance, args, kwargs):
        call = Call(wrapped, args, kwargs)
        chunks = _chunks(call["model_chunks"])
        marked = [getattr(c, MARK, False) for c in chunks]
        if not any(marked):
            return wrapped(*args, **kwargs)
        if not all(marked):
            raise ConfigError("megatron-fsdp-lean-state: some model chunks were built without it; build all alike")
        config = lean_config(call["config"])
        if self.link_buffer:
            for chunk in chunks:
                chunk.param_and_grad_buffer.use_precision_aware_optimizer = True  # megatron-core never sets it
        optimizer = call(config=config)
        for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            _LEAN_OPTIMIZERS.add(inner)
            adam = getattr(inner, "optimizer", None)
            if self.keep_masters and getattr(adam, "master_weights", None) is False:
                # megatron 0.19 clears it over Megatron-FSDP (its masters would be the main-weight buffer,
                # absent here): the Adam's remainders are the masters
                adam.master_weights = True
        return optimizer


def grads_for_norm(wrapped, instance, args, kwargs) -> list[torch.Tensor]:
    """Wrapper of ``MegatronOptimizer.get_main_grads_for_grad_norm``: for an optimizer built over lean
    chunks, megatron's filters over the decoupled gradients' local shards (a Megatron-FSDP parameter's
    ``.grad`` is None under the precision-aware optimizer); any other optimizer, megatron's own."""
    if instance not in _LEAN_OPTIMIZERS:
        return wrapped(*args, **kwargs)
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import param_is_not_shared

    grads = []
    for param in instance.get_parameters():
        grad = getattr(param, "decoupled_grad", None)
        if grad is None:
            continue
        grad = getattr(grad, "_local_tensor", grad)
        if param_is_not_shared(param) and tensor_parallel.param_is_not_tensor_parallel_duplicate(
            param, getattr(instance, "tp_group", None)
        ):
            grads.append(grad)
    return grads
