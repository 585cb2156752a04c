"""Shared BF16/FP32 parameter storage (``--reuse-fp32-param``).

With bf16 mixed precision megatron's ``Float16OptimizerWithFloat16Params`` keeps the model's
bf16 weight (2 B/param) and an fp32 master clone (4 B/param). With this feature each such
parameter owns one 4-byte-per-element buffer (``mindspeed_like.kernels.bf16_residual``):
between steps it holds ``[bf16 weights | int16 residuals]`` and the model's parameter is a
contiguous bf16 *view* of its first half; right around the inner ``optimizer.step()`` the
buffer is converted in place to the exact fp32 master (the optimizer's parameter is the
same buffer viewed as fp32) and back. Rare ties that a 16-bit residual cannot hold go to a
per-parameter side table. Training is bitwise identical to megatron's (tests prove it).

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
- ``megatron.training.arguments.validate_args`` (WRAP, optional: Megatron-LM only): the same
  error at start-up when ``--reuse-fp32-param`` is given without ``--bf16``.

DistributedOptimizer (``mindspeed_like.patches.reuse_fp32_distopt`` holds the layout):

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

import logging
from dataclasses import dataclass, field

import torch

from mindspeed_like.config import ConfigError
from mindspeed_like.features.base import Feature, Flag
from mindspeed_like.features.fallback import Fallback
from mindspeed_like.kernels import bf16_residual as kernel
from mindspeed_like.patching import Kind, Patch

logger = logging.getLogger(__name__)
OPTIMIZER = "megatron.core.optimizer.optimizer"
FLOAT16 = f"{OPTIMIZER}.Float16OptimizerWithFloat16Params"
DISTRIB = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
# Methods that read or write the master shards outside the step (checkpoint formats, reload).
DISTRIB_MASTER_READERS = (
    "state_dict",
    "load_state_dict",
    "sharded_state_dict",
    "get_parameter_state_dp_zero",
    "load_parameter_state_from_dp_zero",
    "load_parameter_state_from_dp_zero_legacy",
    "load_parameter_state_from_fs_model_space",
    "_copy_model_params_to_main_params",
    "_get_main_param_and_optimizer_states",
    "_set_main_param_and_optimizer_states",
)
# The bucket-space format was replaced by the DP-reshardable ones in megatron-core 0.15.
DISTRIB_READERS_BEFORE_0_15 = ("get_parameter_state_fs_bucket_space", "load_parameter_state_from_fs_bucket_space")
DISTRIB_READERS_SINCE_0_15 = (
    "get_parameter_state_dp_reshardable",
    "load_parameter_state_from_dp_reshardable",
    "load_parameter_state_from_fully_reshardable",
)
ARGUMENTS_MODULE = "megatron.training.arguments"
STATE_ATTR = "_mindspeed_reuse_fp32"


class ReuseFp32ParamUnsupported(RuntimeError):
    """The feature cannot run on this optimizer and ``strict`` is on."""


def bf16_required_message(what: str) -> str:
    return (
        f"--reuse-fp32-param needs bf16 mixed-precision training, but {what}. "
        "Train with bf16 (Megatron-LM: --bf16; megatron-core: OptimizerConfig(bf16=True) and a bf16 "
        "TransformerConfig) or switch the feature off (drop --reuse-fp32-param / "
        "mindspeed_like.configure(reuse_fp32_param=False))."
    )


def _flag_on() -> bool:
    import mindspeed_like

    return bool(mindspeed_like.current_config()["reuse_fp32_param"])


_fall_back = Fallback("reuse-fp32-param", ReuseFp32ParamUnsupported, "keeping megatron's separate fp32 masters", logger)
_logged = _fall_back.logged  # reasons already logged


@dataclass
class Shared:
    """One parameter's shared buffer: the model param and its master are views of ``buf``."""

    model_param: torch.nn.Parameter
    main_param: torch.Tensor
    buf: torch.Tensor
    side: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.model_param.shape


@dataclass
class ReuseState:
    """All shared buffers of one optimizer and which layout they are in."""

    entries: list[Shared] = field(default_factory=list)
    layout: str = "split"  # "split" between steps, "fp32" around the inner optimizer step
    chunk: int = kernel.DEFAULT_CHUNK

    def to_fp32(self) -> None:
        if self.layout == "fp32":
            return
        for entry in self.entries:
            kernel.to_fp32(entry.buf, entry.side, self.chunk)
        self.layout = "fp32"

    def to_split(self) -> None:
        if self.layout == "split":
            return
        for entry in self.entries:
            entry.side = kernel.to_split(entry.buf, self.chunk)
        self.layout = "split"

    def side_table_bytes(self) -> int:
        return sum(e.side.numel() * e.side.element_size() for e in self.entries)

    def extra_bytes(self) -> int:
        """Bytes held outside the shared param storages (the side tables)."""
        return self.side_table_bytes()


def state_of(optimizer) -> ReuseState | None:
    """The feature's state on a megatron optimizer, or None when it keeps megatron's layout."""
    return getattr(optimizer, STATE_ATTR, None)


def _owns_its_storage(param: torch.Tensor) -> bool:
    return param.storage_offset() == 0 and param.untyped_storage().nbytes() == param.numel() * param.element_size()


def _share(optimizer) -> None:
    state = ReuseState()
    pairs = [
        (model, main)
        for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
        for model, main in zip(model_group, main_group)
    ]
    for model, _ in pairs:
        if model.dtype != torch.bfloat16:
            raise ConfigError(bf16_required_message(f"a {model.dtype} parameter reached the fp16 optimizer"))
        if not model.is_contiguous() or not _owns_its_storage(model):
            _fall_back("a bf16 parameter is a view into a shared buffer")
            return
    with torch.no_grad():
        for model, main in pairs:
            buf = kernel.new_buffer(model.data)  # master == bf16 weight exactly: residuals 0
            model.data = kernel.bf16_view(buf, model.shape)
            main.data = kernel.fp32_view(buf, model.shape)
            state.entries.append(Shared(model, main, buf, kernel._empty_side(buf.device)))
    setattr(optimizer, STATE_ATTR, state)


# ---------------------------------------------------------------- wrappers


def _float16_init(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if not _flag_on() or instance.is_stub_optimizer:
        return result
    if not instance.config.bf16:
        raise ConfigError(bf16_required_message("the optimizer is configured for fp16 (OptimizerConfig.fp16=True)"))
    _share(instance)
    return result


def _fp32_init(wrapped, instance, args, kwargs):
    if _flag_on():
        raise ConfigError(bf16_required_message("megatron built FP32Optimizer (neither bf16 nor fp16 is on)"))
    return wrapped(*args, **kwargs)


def _distributed_init(wrapped, instance, args, kwargs):
    from mindspeed_like.patches import reuse_fp32_distopt

    result = wrapped(*args, **kwargs)
    if not _flag_on() or instance.is_stub_optimizer:
        return result
    if not instance.config.bf16:
        raise ConfigError(bf16_required_message("the optimizer is configured for fp16 (OptimizerConfig.fp16=True)"))
    state = reuse_fp32_distopt.build(instance)
    if isinstance(state, str):
        _fall_back(f"DistributedOptimizer: {state}")
    else:
        setattr(instance, STATE_ATTR, state)
    return result


def _materialize_first(wrapped, instance, args, kwargs):
    """DistributedOptimizer methods that read or write masters directly (checkpoints, reload)."""
    state = state_of(instance)
    if state is not None:
        with torch.no_grad():
            state.materialize()
    return wrapped(*args, **kwargs)


def _step_with_ready_grads(wrapped, instance, args, kwargs):
    state = state_of(instance)
    if state is None:
        return wrapped(*args, **kwargs)
    with torch.no_grad():
        state.to_fp32()
        try:
            return wrapped(*args, **kwargs)  # inner step, then _copy_main_params_to_model_params
        finally:
            state.to_split()  # normally already done by the copy-back; also after an exception


def _copy_main_params_to_model_params(wrapped, instance, args, kwargs):
    state = state_of(instance)
    if state is None:
        return wrapped(*args, **kwargs)
    with torch.no_grad():
        state.to_split()


def _copy_model_params_to_main_params(wrapped, instance, args, kwargs):
    state = state_of(instance)
    if state is None:
        return wrapped(*args, **kwargs)

    def bind(state_dict=None):
        return state_dict

    assert bind(*args, **kwargs) is None, "Initialize main params from state dict is not supported"
    with torch.no_grad():
        state.to_split()
        for entry in state.entries:
            entry.buf[entry.buf.numel() // 2 :].zero_()
            entry.side = kernel._empty_side(entry.buf.device)


def _state_dict(wrapped, instance, args, kwargs):
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


def _load_state_dict(wrapped, instance, args, kwargs):
    state = state_of(instance)
    if state is None:
        return wrapped(*args, **kwargs)
    with torch.no_grad():
        state.to_fp32()  # masters the checkpoint does not name stay exact
        try:
            return wrapped(*args, **kwargs)
        finally:
            state.to_split()


def _validate_args(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    namespace = args[0] if args else kwargs["args"]
    if _flag_on() and not getattr(namespace, "bf16", False):
        raise ConfigError(bf16_required_message("--bf16 is not set"))
    return result


def _reader_patch(name: str) -> Patch:
    return Patch(f"{DISTRIB}.{name}", Kind.WRAP, _materialize_first, why="reads/writes fp32 masters: materialize")


_VERSIONED_READERS = {
    True: [_reader_patch(name) for name in DISTRIB_READERS_SINCE_0_15],
    False: [_reader_patch(name) for name in DISTRIB_READERS_BEFORE_0_15],
}


def patches_for_installed_megatron(config) -> list[Patch]:
    """PATCHES plus the DistributedOptimizer checkpoint methods of the installed megatron-core."""
    from packaging.version import Version

    from mindspeed_like.megatron_version import megatron_core_version

    version = megatron_core_version()
    return [*PATCHES, *_VERSIONED_READERS[version is None or version >= Version("0.15")]]


PATCHES = [
    Patch(f"{FLOAT16}.__init__", Kind.WRAP, _float16_init, why="masters move into shared bf16/residual buffers"),
    Patch(
        f"{OPTIMIZER}.MixedPrecisionOptimizer.step_with_ready_grads",
        Kind.WRAP,
        _step_with_ready_grads,
        why="buffers become exact fp32 masters only around the inner optimizer step",
    ),
    Patch(
        f"{FLOAT16}._copy_main_params_to_model_params",
        Kind.WRAP,
        _copy_main_params_to_model_params,
        why="copy-back replaced by the in-place conversion to bf16 + residual",
    ),
    Patch(
        f"{FLOAT16}._copy_model_params_to_main_params",
        Kind.WRAP,
        _copy_model_params_to_main_params,
        why="reload_model_params: master = bf16 weight (residuals 0)",
    ),
    Patch(f"{FLOAT16}.state_dict", Kind.WRAP, _state_dict, why="checkpoints hold plain fp32 masters"),
    Patch(f"{FLOAT16}.load_state_dict", Kind.WRAP, _load_state_dict, why="loaded fp32 masters re-split in place"),
    Patch(f"{OPTIMIZER}.FP32Optimizer.__init__", Kind.WRAP, _fp32_init, why="flag needs bf16: clear error"),
    Patch(
        f"{DISTRIB}.__init__",
        Kind.WRAP,
        _distributed_init,
        why="master shards become residual shards beside the bf16 param buffer",
    ),
    Patch(
        f"{DISTRIB}._copy_main_params_to_model_params",
        Kind.WRAP,
        _copy_main_params_to_model_params,
        why="copy into the param buffer replaced by the split back to bf16 shard + residual",
    ),
    *[_reader_patch(name) for name in DISTRIB_MASTER_READERS],
    Patch(
        f"{ARGUMENTS_MODULE}.validate_args",
        Kind.WRAP,
        _validate_args,
        optional=True,
        module=ARGUMENTS_MODULE,
        why="Megatron-LM: --reuse-fp32-param without --bf16 is a start-up error",
    ),
]


FEATURE = Feature(
    name="reuse-fp32-param",
    summary="bf16 weights live inside their fp32 masters' storage: 4 B/param instead of 6, bitwise exact",
    patches=patches_for_installed_megatron,
    flags=(
        Flag(
            "reuse_fp32_param",
            bool,
            False,
            "keep each bf16 parameter and its fp32 master in one 4-byte storage (bf16 mixed precision; "
            "Float16OptimizerWithFloat16Params: 6 -> 4 B/param, DistributedOptimizer at DP>=2: "
            "residual shards save 2 B/param/DP; bitwise identical training)",
        ),
    ),
    backend=lambda config: "portable",
)
