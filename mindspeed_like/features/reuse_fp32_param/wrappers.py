"""reuse-fp32-param's wrappers of megatron's optimizer methods; they drive the Float16 layout
(``float16.py``) and the DistributedOptimizer layout (``distributed.py``) of the optimizers the
feature set up (optimizers it did not set up pass through untouched).

Targets (all on ``megatron.core.optimizer.optimizer``), and why each is the right symbol:

- ``Float16OptimizerWithFloat16Params.__init__`` (WRAP): the master clones are created inline
  there (no narrower hook); afterwards each (model param, master) pair is moved into one
  shared buffer and the clone is freed. The model param's ``.data`` and the master's
  ``.data`` are re-pointed, so every object megatron and torch hold (the ``Parameter``, the
  optimizer's param, ``param.main_param``, optimizer state keys) stays the same.
- ``MixedPrecisionOptimizer.step_with_ready_grads`` (WRAP): the only place megatron runs the
  inner ``optimizer.step()`` and then copies masters to the model. Converting to fp32 only
  here means a skipped step (found inf/nan: ``step`` returns before this) never touches the
  layout, and gradient clipping / weight decay run exactly as megatron's. Defined on the base
  class (shared with ``DistributedOptimizer``), so the wrapper acts only on optimizers this
  feature set up.
- ``Float16OptimizerWithFloat16Params._copy_main_params_to_model_params`` (WRAP): megatron's
  copy-back after the step; ours converts the buffer back to the split layout instead
  (the bf16 weight *is* the rounded master: no copy).
- ``Float16OptimizerWithFloat16Params._copy_model_params_to_main_params`` (WRAP):
  ``reload_model_params`` (after a model-only checkpoint load) sets master = bf16 weight:
  residuals 0 and an empty side table.
- ``Float16OptimizerWithFloat16Params.state_dict`` (WRAP): megatron returns the master
  tensors themselves; ours returns exact fp32 copies decoded from the buffers, so checkpoints
  (``torch.save`` and ``sharded_state_dict``, which calls ``state_dict``) are plain megatron
  format and load with or without the flag.
- ``Float16OptimizerWithFloat16Params.load_state_dict`` (WRAP): megatron copies saved fp32
  masters into the master tensors; ours converts the buffers to fp32 first (so any master
  the checkpoint does not cover stays exact) and back to the split layout afterwards.
- ``FP32Optimizer.__init__`` (WRAP): built when neither bf16 nor fp16 is on: the flag needs
  bf16, so this is a clear error.
- Megatron-LM's ``validate_args`` (the feature's hook of the one wrap): the same error at
  start-up when ``--reuse-fp32-param`` is given without ``--bf16``.

DistributedOptimizer (``distributed.py`` holds the layout):

- ``DistributedOptimizer.__init__`` (WRAP): the master shards are cloned inline; afterwards they
  become residual shards beside DDP's bf16 param buffer (the masters' high halves are the
  rank's own bf16 shard already there) and the clones are freed.
- ``DistributedOptimizer._copy_main_params_to_model_params`` (WRAP): megatron copies the
  masters into the param buffer before its all-gather; ours splits them back into the bf16
  shard + residuals (the step itself goes through ``step_with_ready_grads`` above).
- the checkpoint / reload methods that read or write masters (``state_dict``,
  ``sharded_state_dict``, ``get_parameter_state_*``, ``load_parameter_state_from_*``,
  ``_get/_set_main_param_and_optimizer_states``, ``_copy_model_params_to_main_params``; WRAP;
  the bucket-space format before 0.15, the DP-reshardable ones since): real fp32 masters are
  materialized first
  (megatron's own memory for them, until the next step splits them again).

Not covered (megatron's path, one log line; an error under ``strict``): DistributedOptimizer at
DP=1 (no room for the masters in the param buffer), with FSDP, a precision-aware optimizer or
several optimizer instances; parameters that already live inside a shared buffer. fp16 is a
clear error (a bf16-only scheme).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mindspeed_like.features.reuse_fp32_param import chunked_step, distributed, live
from mindspeed_like.features.reuse_fp32_param.float16 import (
    STATE_ATTR,
    ReuseState,
    Shared,
    bf16_required_message,
    share,
    state_of,
)
from mindspeed_like.kernels import bf16_residual as kernel
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.fallback import Fallback


def _holds_bf16_params(optimizer) -> bool:
    """False for megatron's stub optimizer (no parameters on this rank: nothing to share); an
    fp16 optimizer is an error (the residual trick needs bf16's layout inside fp32)."""
    if optimizer.is_stub_optimizer:
        return False
    if not optimizer.config.bf16:
        raise ConfigError(bf16_required_message("the optimizer is configured for fp16 (OptimizerConfig.fp16=True)"))
    return True


@dataclass(frozen=True)
class Float16Init:
    """Wrapper of ``Float16OptimizerWithFloat16Params.__init__``: masters move into shared buffers."""

    fall_back: Fallback

    def __call__(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        live.seen(instance)
        if not _holds_bf16_params(instance):
            return result
        share(instance, self.fall_back)
        if state_of(instance) is not None:
            live.track(instance)
        return result


@dataclass(frozen=True)
class Fp32Init:
    """Wrapper of ``FP32Optimizer.__init__``: the feature needs bf16. Asked for by name, that is a
    clear error; switched on by ``--optimization-level 2`` (which means "where it applies"), the
    run goes on with megatron's FP32Optimizer and the fallback says so once."""

    from_level: bool
    fall_back: Fallback

    def __call__(self, wrapped, instance, args, kwargs):
        what = "megatron built FP32Optimizer (neither bf16 nor fp16 is on)"
        if not self.from_level:
            raise ConfigError(bf16_required_message(what))
        self.fall_back(f"fp32 training: {what}; it saves memory only in bf16 training")
        return wrapped(*args, **kwargs)


@dataclass(frozen=True)
class DistributedInit:
    """Wrapper of ``DistributedOptimizer.__init__``: master shards become residual shards."""

    fall_back: Fallback

    def __call__(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        live.seen(instance)
        if not _holds_bf16_params(instance):
            return result
        state = distributed.build(instance)
        if isinstance(state, str):
            self.fall_back(f"DistributedOptimizer: {state}")
        else:
            setattr(instance, STATE_ATTR, state)
            live.track(instance)
        return result


def materialize_first(wrapped, instance, args, kwargs):
    """DistributedOptimizer methods that read or write masters directly (checkpoints, reload)."""
    state = state_of(instance)
    if state is not None:
        with torch.no_grad():
            state.materialize()
    return wrapped(*args, **kwargs)


@dataclass(frozen=True)
class StepWithReadyGrads:
    """Wrapper of ``MixedPrecisionOptimizer.step_with_ready_grads``: the buffers hold exact fp32
    masters only around the inner step. An optimizer built before the feature was switched on
    keeps megatron's layout: said once (an error under strict), not silently."""

    fall_back: Fallback

    def __call__(self, wrapped, instance, args, kwargs):
        if state_of(instance) is None and not live.was_seen(instance):
            self.fall_back(
                f"{type(instance).__name__} was built before --reuse-fp32-param was switched on and keeps "
                "megatron's separate fp32 masters; build the optimizer after switching the feature on"
            )
        return step_with_ready_grads(wrapped, instance, args, kwargs)


def step_with_ready_grads(wrapped, instance, args, kwargs):
    state = state_of(instance)
    if state is None:
        return wrapped(*args, **kwargs)
    inner = getattr(instance, "optimizer", None)
    chunkable = inner is not None and isinstance(state, ReuseState) and state.layout == "split"
    if chunkable and chunked_step.unsupported(inner) is None:
        entries = {id(entry.main_param): entry for entry in state.entries}
        fallback = inner.step

        def inner_step(closure=None):  # torch's Adam math chunk by chunk on the split layout
            if closure is not None:
                with torch.no_grad():
                    state.to_fp32()
                    return fallback(closure)
            replaced = chunked_step.run_pre_hooks(inner)  # as torch's step runs them, before its body
            args, kwargs = replaced or ((inner,), {})
            out = None
            if replaced is not None or not chunked_step.step(inner, entries, state.batch):
                with torch.no_grad():
                    state.to_fp32()
                    out = chunked_step.unhooked_step(inner, args, kwargs)
            chunked_step.run_post_hooks(inner, args, kwargs)
            return out

        with chunked_step.replaced_step(inner, inner_step):
            try:
                return wrapped(*args, **kwargs)  # inner step, then _copy_main_params_to_model_params
            finally:
                with torch.no_grad():
                    state.to_split()  # only the shuffling fallback left it in fp32
    with torch.no_grad():
        state.to_fp32()
        try:
            return wrapped(*args, **kwargs)  # inner step, then _copy_main_params_to_model_params
        finally:
            state.to_split()  # normally already done by the copy-back; also after an exception


def copy_main_params_to_model_params(wrapped, instance, args, kwargs):
    state = state_of(instance)
    if state is None:
        return wrapped(*args, **kwargs)
    with torch.no_grad():
        state.to_split()


def copy_model_params_to_main_params(wrapped, instance, args, kwargs):
    state = state_of(instance)
    if state is None:
        return wrapped(*args, **kwargs)

    assert Call(wrapped, args, kwargs).get("state_dict") is None, (
        "Initialize main params from state dict is not supported"
    )
    with torch.no_grad():
        state.to_split()
        for entry in state.entries:
            entry.buf[entry.buf.numel() // 2 :].zero_()
            entry.side.clear()


def state_dict(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    state = state_of(instance)
    if state is None or "fp32_from_fp16_params" not in result:
        return result
    copies = {id(e.main_param): e for e in state.entries}
    with torch.no_grad():
        result["fp32_from_fp16_params"] = [
            [_master_copy(copies[id(p)], p, state) if id(p) in copies else p for p in group]
            for group in result["fp32_from_fp16_params"]
        ]
    return result


def _master_copy(entry: Shared, main: torch.Tensor, state: ReuseState) -> torch.Tensor:
    if state.layout == "fp32":
        copy = main.detach().clone()
    else:
        copy = kernel.master_copy(entry.buf, entry.side, entry.shape, state.chunk)
    from megatron.core import tensor_parallel

    tensor_parallel.copy_tensor_model_parallel_attributes(copy, main)
    if hasattr(main, "shared"):
        copy.shared = main.shared
    return copy


def load_state_dict(wrapped, instance, args, kwargs):
    state = state_of(instance)
    if state is None:
        return wrapped(*args, **kwargs)
    with torch.no_grad():
        state.to_fp32()  # masters the checkpoint does not name stay exact
        try:
            return wrapped(*args, **kwargs)
        finally:
            state.to_split()


@contextlib.contextmanager
def bf16_required(args) -> Iterator[None]:
    """validate_args hook (Megatron-LM): --reuse-fp32-param without --bf16 is a start-up error
    (given on the command line; switched on by --optimization-level 2 it steps aside in fp32)."""
    yield
    if getattr(args, "reuse_fp32_param", False) and not getattr(args, "bf16", False):
        raise ConfigError(bf16_required_message("--bf16 is not set"))
