"""The wrappers: megatron's precision-aware optimizer path with our Adam where TE's is absent.

Targets, and why each is the right one (megatron-core 0.16.1):

* ``optimizer_config.OptimizerConfig.__post_init__``: with ``use_precision_aware_optimizer`` it
  imports TE's FusedAdam and raises ``RuntimeError('... requires FusedAdam from
  TransformerEngine')``. We run it as if ``optimizer_cpu_offload`` were set (that branch returns
  right after the same assertions, before the TE import), then recompute the one field that read
  the flag (``use_precision_aware_optimizer_no_fp8_or_ds_fp8``) from the real value.
* ``is_te_min_version`` as bound in ``optimizer_config`` and ``optimizer`` (module-local names,
  not megatron-wide): without TE it raises ``TypeError: '>=' not supported between 'NoneType'
  and 'Version'``. There it only asks which FusedAdam API exists (``store_param_remainders``
  from TE 2.1), so without TE it answers for the Adam standing in: :data:`TE_API`.
* ``optimizer._get_megatron_optimizer_based_on_param_groups``: it picks ``torch.optim.AdamW``
  when neither TE nor apex is installed (``USING_PYTORCH_OPTIMIZER``) and then passes TE-only
  keywords to it. For a precision-aware config we run it with the module's ``Adam`` bound to
  :class:`~mindspeed_like.kernels.adam.PrecisionAwareAdam` and ``USING_PYTORCH_OPTIMIZER``
  False, restoring both afterwards (megatron builds its optimizers on one thread); likewise
  ``distrib_optimizer.Adam`` (torch's Adam without TE), which ``DistributedOptimizer.__init__``
  asserts the inner optimizer is an instance of.

  Over Megatron-FSDP chunks, megatron-core 0.18+'s ``get_megatron_optimizer`` sets TE FusedAdam's
  ``master_weights`` False and ``use_decoupled_grad`` True after this build, keyed on ``not
  USING_PYTORCH_OPTIMIZER`` (restored to True here once the build returns): done to our Adam by this
  wrapper (:func:`clears_fsdp_master_weights`, :func:`_as_over_megatron_fsdp`), so it holds no
  remainders TE's Adam would not.

  megatron-core 0.13 passes ``master_weights``/``use_decoupled_grad`` to the Adam only when
  ``main_params_dtype`` is not fp32 or ``fp8_recipe == "delayed"`` (Megatron-LM's default), while
  its DistributedOptimizer writes ``decoupled_grad`` whenever
  ``use_precision_aware_optimizer_no_fp8_or_ds_fp8``; with OptimizerConfig's own default
  ``fp8_recipe=None`` the Adam then never sees a gradient and nothing trains. 0.14 keyed both on
  that one field; :class:`_AdamForConfig` builds the Adam by 0.14's rule on every release.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from packaging.version import Version

from mindspeed_like.te_backend.versions import TE_LAYERS_API
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.errors import LevelConflict

TE_API = TE_LAYERS_API
"""The TE FusedAdam API our Adam implements (keywords, initialize_state, get_unscaled_state /
set_scaled_state, store_param_remainders; TE 2.1's): megatron's checks of TE >= this pass without TE.
The te-backend's layer API answers the same version, so a process sees one TE version."""

CONFIG_MODULE = "megatron.core.optimizer.optimizer_config"
OPTIMIZER_MODULE = "megatron.core.optimizer"
DISTRIB_MODULE = "megatron.core.optimizer.distrib_optimizer"


def te_fused_adam_available() -> bool:
    """Whether TransformerEngine's FusedAdam can be imported (then megatron's own path is used)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam  # noqa: F401
    except ImportError:
        return False
    return True


def conflict_message() -> str:
    """Both asked for by name (switched on by ``--optimization-level 2``, reuse-fp32-param steps
    aside instead: :func:`conflict`)."""
    return (
        "--reuse-fp32-param and --use-precision-aware-optimizer both change where the fp32 masters "
        "live and cannot be combined: the precision-aware optimizer already keeps each master as the "
        "bf16 weight plus an int16 remainder (store_param_remainders, the same 4 bytes). "
        "Drop --reuse-fp32-param (or --use-precision-aware-optimizer)."
    )


def conflict() -> LevelConflict:
    """reuse-fp32-param against megatron's --use-precision-aware-optimizer: the runtime makes a
    reuse-fp32-param that ``--optimization-level 2`` switched on step aside, else it is the error."""
    return LevelConflict("reuse-fp32-param", "--use-precision-aware-optimizer", conflict_message())


def te_min_version(version: str, check_equality: bool = True) -> bool:
    """``is_te_min_version`` for megatron's optimizer modules: TE's answer when TE is installed,
    otherwise whether the stand-in Adam's API (:data:`TE_API`) is at least ``version``."""
    if te_fused_adam_available():
        from megatron.core.utils import is_te_min_version

        return is_te_min_version(version, check_equality)
    wanted = Version(version)
    return TE_API >= wanted if check_equality else TE_API > wanted


@dataclass(frozen=True)
class ConfigPostInit:
    """Wrapper of ``OptimizerConfig.__post_init__``: no TE import demanded when we stand in."""

    def __call__(self, wrapped, instance, args, kwargs):
        if not instance.use_precision_aware_optimizer or instance.optimizer_cpu_offload or te_fused_adam_available():
            return wrapped(*args, **kwargs)
        instance.optimizer_cpu_offload = True
        try:
            wrapped(*args, **kwargs)
        finally:
            instance.optimizer_cpu_offload = False
        instance.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = instance.main_params_dtype != torch.float32 or (
            instance.fp8_recipe in (None, "delayed")
        )
        return None


@dataclass(frozen=True)
class BuildOptimizer:
    """Wrapper of ``_get_megatron_optimizer_based_on_param_groups``: our Adam for precision-aware configs.

    reuse_fp32_param: that feature is on; it cannot be combined (:func:`conflict`, except over
    Megatron-FSDP chunks, where reuse-fp32-param steps aside by itself): handed to
    ``resolve_conflict`` (the runtime's: a level's reuse-fp32-param steps aside, switched off
    before this optimizer is built; asked for by name, the error), or raised without one."""

    reuse_fp32_param: bool = False
    resolve_conflict: Callable[[LevelConflict], object] | None = None

    def __call__(self, wrapped, instance, args, kwargs):
        call = Call(wrapped, args, kwargs)
        config = call["config"]
        if not getattr(config, "use_precision_aware_optimizer", False) or te_fused_adam_available():
            return wrapped(*args, **kwargs)
        if self.reuse_fp32_param and not _megatron_fsdp(call.get("model_chunks")):
            if self.resolve_conflict is None:
                raise conflict()
            self.resolve_conflict(conflict())
        from mindspeed_like.kernels.adam import PrecisionAwareAdam

        # (module, name, value) for the call; USING_PYTORCH_OPTIMIZER exists from megatron-core 0.15
        swaps = [
            (sys.modules[OPTIMIZER_MODULE], "Adam", _AdamForConfig(config)),
            (sys.modules[OPTIMIZER_MODULE], "USING_PYTORCH_OPTIMIZER", False),
            (sys.modules[DISTRIB_MODULE], "Adam", PrecisionAwareAdam),
        ]
        swaps = [(m, name, value) for m, name, value in swaps if hasattr(m, name)]
        saved = [(m, name, getattr(m, name)) for m, name, _ in swaps]
        for m, name, value in swaps:
            setattr(m, name, value)
        try:
            optimizer = wrapped(*args, **kwargs)
        finally:
            for m, name, value in saved:
                setattr(m, name, value)
        if _megatron_fsdp(call.get("model_chunks")) and clears_fsdp_master_weights():
            _as_over_megatron_fsdp(optimizer)
        return optimizer


def clears_fsdp_master_weights() -> bool:
    """Whether the installed ``get_megatron_optimizer`` turns the precision-aware Adam's own masters off over
    Megatron-FSDP chunks (megatron-core 0.18+: ``setattr(optimizer_part.optimizer, "master_weights", False)``
    and ``use_decoupled_grad`` True, after the build). Read from its code, not a version number."""
    import inspect

    from megatron.core import optimizer as megatron_optimizer

    try:
        source = inspect.getsource(megatron_optimizer.get_megatron_optimizer)
    except (OSError, TypeError):
        return False
    return '"master_weights", False' in source or "'master_weights', False" in source


def _as_over_megatron_fsdp(optimizer) -> None:
    """What megatron-core 0.18+'s ``get_megatron_optimizer`` does to TE's FusedAdam over Megatron-FSDP chunks,
    done to our Adam: no masters of its own (the optimizer steps Megatron-FSDP's main-weight buffer, or the
    weight shard where there is none: no int16 remainders, no fp16 master copy) and decoupled gradients.
    Megatron keys it on ``not USING_PYTORCH_OPTIMIZER``, which is False with TE but True on a host without
    TE or Apex once our build returns, so without this our Adam kept masters TE's would not hold (2 B an
    element of the shard with bf16 or ``auto`` main params). Before any state exists: megatron builds the
    state lazily (``init_state_fn`` / the first step)."""
    from mindspeed_like.kernels.adam import PrecisionAwareAdam

    adam = getattr(optimizer, "optimizer", None)
    if isinstance(adam, PrecisionAwareAdam) and adam.master_weights:
        adam.master_weights = False
        adam.use_decoupled_grad = True


def _megatron_fsdp(model_chunks) -> bool:
    """Whether the optimizer is built over Megatron-FSDP chunks, where reuse-fp32-param steps aside by
    itself (its masters are Megatron-FSDP's buffers): no conflict to resolve there."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return any(getattr(getattr(c, "ddp_config", None), "use_megatron_fsdp", False) for c in chunks)


@dataclass(frozen=True)
class _AdamForConfig:
    """Stands for ``Adam`` in megatron's optimizer module during one build: PrecisionAwareAdam with
    the masters and decoupled grads keyed on ``use_precision_aware_optimizer_no_fp8_or_ds_fp8``,
    the field megatron's DistributedOptimizer reads (0.14+'s rule; see the module docstring)."""

    config: object

    def __call__(self, *args, **kwargs):
        from mindspeed_like.kernels.adam import PrecisionAwareAdam

        if getattr(self.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            kwargs.setdefault("master_weights", True)
            kwargs.setdefault("use_decoupled_grad", True)
            kwargs.setdefault("master_weight_dtype", self.config.main_params_dtype)
        return PrecisionAwareAdam(*args, **kwargs)
