"""MoE grouped GEMM (feature ``grouped-gemm``): megatron's ``moe_grouped_gemm`` on any machine.

megatron-core's legacy ``GroupedMLP`` (what the local spec builds for
``TransformerConfig(moe_grouped_gemm=True)`` / Megatron-LM's ``--moe-grouped-gemm``) needs the
CUDA-only ``grouped_gemm`` package: without it ``__init__`` fails an assertion, and the forward
calls ``gg.ops.gmm`` on ``ops = None``. This feature provides that op from
``mindspeed_like.kernels.grouped_gemm`` (torch_npu's ``npu_grouped_matmul`` on an NPU, a
portable kernel elsewhere).

On by default exactly where megatron would crash: ``--grouped-gemm auto`` (the default) applies
the patches only when the ``grouped_gemm`` package is NOT importable, so a working CUDA package
is never replaced unless asked (``--grouped-gemm on``); ``--grouped-gemm off`` leaves megatron
untouched. This makes plain megatron-core scripts with ``moe_grouped_gemm=True`` work with the
one import line and no flag.

Targets, and why each is the right symbol:

- ``megatron.core.transformer.moe.grouped_gemm_util.ops`` (REPLACE, no alias scan): experts.py
  imports the *module* (``grouped_gemm_util as gg``) and looks up ``gg.ops.gmm`` at call time,
  so the module attribute is the one place to fill. Its original value is ``None`` without the
  package; scanning other modules for aliases of ``None`` would be wrong, and nobody imports
  ``ops`` by name.
- ``megatron.core.transformer.moe.grouped_gemm_util.assert_grouped_gemm_is_available``
  (REPLACE): called (via ``gg.``) by ``GroupedMLP.__init__``; with our op provided the
  assertion's premise holds. ``grouped_gemm_is_available`` is left alone: it still answers
  truthfully whether the CUDA package exists.
- ``megatron.core.transformer.moe.experts.GroupedMLP.forward`` (WRAP): megatron-core 0.16
  asserts ``config.bf16`` at the top of forward (0.13-0.15 do not), a limit of the CUTLASS
  kernels, not of the math: ours computes fp32 (and fp16) exactly. When our op is installed
  and the config is not bf16, the call runs with a shallow config view that has ``bf16=True``;
  nothing else in ``forward`` reads ``bf16``. With the CUDA package in charge
  (``--grouped-gemm auto`` and the package present) the assertion stays.

- ``megatron.core.transformer.moe.experts.GroupedMLP.__init__`` (WRAP, CPU host only): without
  ``use_cpu_initialization`` it allocates the weights on ``torch.cuda.current_device()``; it
  runs as its host twin (the cpu-adapter's ``on_host``, as for ColumnParallelLinear). The
  cpu-adapter never needed it: megatron's assertion stopped GroupedMLP before that line.
- ``megatron.training.arguments.validate_args`` (WRAP, optional: megatron.training exists only
  in Megatron-LM checkouts; waits for its import): for ``--moe-grouped-gemm`` it asserts
  ``torch.cuda.get_device_capability() >= 8``, a requirement of the CUTLASS kernels we replace
  (and a crash on a host without CUDA). That check is the only use of ``moe_grouped_gemm`` in
  ``validate_args`` (Megatron-LM core_v0.16.1), so validation runs with it hidden (False) and
  the parsed value is put back afterwards, logged once. Nothing else is faked.

``--gemm-gradient-accumulation-fusion`` (MindSpeed's flag): the expert weights' gradients are
accumulated straight into megatron DDP's fp32 ``main_grad`` per expert (megatron's
gradient-accumulation-fusion contract: ``grad_added_to_main_grad`` is set and a dummy
gradient returned, as ``LinearWithGradAccumulationAndAsyncCommunication`` does), so no
separate ``[E, K, N]`` weight gradient is materialised. Without DDP's ``main_grad`` the
gradient is computed normally and that is logged once (an error under ``--strict``).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import types

from mindspeed_like.config import Config, ConfigError
from mindspeed_like.device import detect_device
from mindspeed_like.features.base import Feature, Flag, kernel_backend
from mindspeed_like.features.fallback import Fallback
from mindspeed_like.patches.cpu_devices import on_host
from mindspeed_like.patching import Kind, Patch

logger = logging.getLogger(__name__)

GG = "megatron.core.transformer.moe.grouped_gemm_util"
GROUPED_MLP_FORWARD = "megatron.core.transformer.moe.experts.GroupedMLP.forward"


class GroupedGemmUnsupported(RuntimeError):
    """``strict`` is on and a grouped GEMM call cannot run as configured."""


def grouped_gemm_package_installed() -> bool:
    """Whether the CUDA ``grouped_gemm`` package megatron looks for is importable: a package
    (directory with ``ops``), not a stray single-file module of that name on ``sys.path`` such
    as ``benchmarks/grouped_gemm.py`` when a script in that directory runs."""
    spec = importlib.util.find_spec("grouped_gemm")
    return spec is not None and spec.submodule_search_locations is not None


_note = Fallback("grouped-gemm", GroupedGemmUnsupported, "falling back", logger)
_logged = _note.logged  # reasons already logged


def _gmm(a, b, batch_sizes, trans_b=False):
    """``grouped_gemm.ops.gmm``'s signature, backed by our kernel."""
    import mindspeed_like
    from mindspeed_like.kernels.backend import backend_for, force_backend
    from mindspeed_like.kernels.grouped_gemm import MAX_NPU_GROUPS, gmm, main_grad_owner

    owner = None
    if mindspeed_like.current_config()["gemm_gradient_accumulation_fusion"] and b.requires_grad:
        owner = main_grad_owner(b)
        if owner is None:
            _note(
                "--gemm-gradient-accumulation-fusion: the expert weight has no main_grad (not wrapped in "
                "megatron's DistributedDataParallel); its gradient is computed normally"
            )
    if backend_for(a) == "npu" and b.shape[0] > MAX_NPU_GROUPS:
        _note(f"npu_grouped_matmul takes at most {MAX_NPU_GROUPS} groups; {b.shape[0]} experts use the portable loop")
        with force_backend("portable"):
            return gmm(a, b, batch_sizes, trans_b, accumulate_into=owner)
    return gmm(a, b, batch_sizes, trans_b, accumulate_into=owner)


OPS = types.SimpleNamespace(gmm=_gmm)
"""Stands in for ``grouped_gemm.ops`` (only ``gmm`` is used by megatron-core)."""


def _grouped_gemm_available() -> None:
    """Our op is installed in ``grouped_gemm_util.ops``: nothing to assert."""


def _fp32_view(config):
    """A shallow copy of ``config`` with ``bf16=True`` (not re-validated: only the 0.16
    forward's assertion reads it)."""
    view = copy.copy(config)
    object.__setattr__(view, "bf16", True)
    return view


def _grouped_mlp_forward(wrapped, instance, args, kwargs):
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    if instance is None or instance.config.bf16 or gg.ops is not OPS:
        return wrapped(*args, **kwargs)
    original = instance.config
    instance.config = _fp32_view(original)
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.config = original


def _validate_args(wrapped, instance, args, kwargs):
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    parsed = args[0] if args else kwargs.get("args")
    if parsed is None or not getattr(parsed, "moe_grouped_gemm", False) or gg.ops is not OPS:
        return wrapped(*args, **kwargs)
    _note.once(
        "capability",
        "grouped-gemm: Megatron-LM's GroupedGEMM compute-capability check skipped (the kernel is ours)",
        logging.INFO,
    )
    parsed.moe_grouped_gemm = False
    try:
        return wrapped(*args, **kwargs)
    finally:
        parsed.moe_grouped_gemm = True


PATCHES = [
    Patch(
        f"{GG}.ops",
        Kind.REPLACE,
        OPS,
        update_aliases=False,
        why="experts.py calls gg.ops.gmm; None without the CUDA grouped_gemm package",
    ),
    Patch(
        f"{GG}.assert_grouped_gemm_is_available",
        Kind.REPLACE,
        _grouped_gemm_available,
        why="GroupedMLP.__init__ asserts the CUDA package; our gmm is provided instead",
    ),
    Patch(
        GROUPED_MLP_FORWARD,
        Kind.WRAP,
        _grouped_mlp_forward,
        why="megatron-core 0.16 asserts bf16 in forward; our gmm computes fp32/fp16 too",
    ),
    Patch(
        "megatron.training.arguments.validate_args",
        Kind.WRAP,
        _validate_args,
        optional=True,
        module="megatron.training.arguments",
        why="Megatron-LM asserts a CUDA compute capability >= 8 for --moe-grouped-gemm (CUTLASS)",
    ),
]


HOST_INIT = on_host("transformer.moe.experts.GroupedMLP.__init__", "weights on torch.cuda.current_device()")


def patches_for(config: Config) -> list[Patch]:
    """PATCHES, plus GroupedMLP's host-twin constructor on a CPU host."""
    return [*PATCHES, HOST_INIT] if detect_device(config["device"]) == "cpu" else list(PATCHES)


def _enabled(feature: Feature, config: Config) -> bool:
    mode = config["grouped_gemm"]
    on = mode == "on" or (mode == "auto" and not grouped_gemm_package_installed())
    if config["gemm_gradient_accumulation_fusion"] and not on:
        why = "--grouped-gemm off" if mode == "off" else "the grouped_gemm package is installed (--grouped-gemm auto)"
        raise ConfigError(
            f"--gemm-gradient-accumulation-fusion needs mindspeed_like's grouped GEMM, but {why}; "
            "pass --grouped-gemm on, or drop --gemm-gradient-accumulation-fusion"
        )
    return on


FEATURE = Feature(
    name="grouped-gemm",
    summary="megatron's moe_grouped_gemm (GroupedMLP) without the CUDA grouped_gemm package "
    "(torch_npu.npu_grouped_matmul on NPU, a portable grouped GEMM elsewhere)",
    patches=patches_for,
    flags=(
        Flag(
            "grouped_gemm",
            str,
            "auto",
            "provide grouped_gemm.ops.gmm for megatron's GroupedMLP (--moe-grouped-gemm): auto = only when the "
            "CUDA grouped_gemm package is missing; on = also replace an installed package; off = never",
            choices=("auto", "on", "off"),
        ),
        Flag(
            "gemm_gradient_accumulation_fusion",
            bool,
            False,
            "accumulate GroupedMLP's expert weight gradients straight into megatron DDP's main_grad",
        ),
    ),
    enabled=_enabled,
    backend=kernel_backend,
    switched_by="--moe-grouped-gemm builds GroupedMLP; on by default when the grouped_gemm package is missing",
)
