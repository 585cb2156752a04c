"""grouped-gemm's mechanism: megatron's ``moe_grouped_gemm`` (legacy GroupedMLP) on any machine.

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

- On a CPU host ``GroupedMLP.__init__`` allocates its weights on ``torch.cuda.current_device()``
  without ``use_cpu_initialization``; the cpu-adapter runs it as a host twin (device bring-up
  belongs there, not here).
- Megatron-LM's ``validate_args`` (this feature's hook of the one wrap, see
  ``integrations/megatron_lm.py``): for ``--moe-grouped-gemm`` it asserts
  ``torch.cuda.get_device_capability() >= 8``, a requirement of the CUTLASS kernels we replace
  (and a crash on a host without CUDA). That check is the only use of ``moe_grouped_gemm`` in
  ``validate_args`` (Megatron-LM core_v0.16.1), so validation runs with it hidden (False) and
  the parsed value is put back afterwards, logged once. Nothing else is faked.

Gradient-accumulation fusion: wherever the expert weight has megatron DDP's fp32 ``main_grad``,
its gradient is accumulated straight into it per expert (megatron's gradient-accumulation-fusion
contract: ``grad_added_to_main_grad`` is set and a dummy gradient returned, as
``LinearWithGradAccumulationAndAsyncCommunication`` does), so no separate ``[E, K, N]`` weight
gradient is materialised. That is the default because the unfused gradient is a fresh full-size
allocation every step (1.5 GiB at E=64, hidden 1024, ffn 2048 fp32), which the kernel
page-faults in (439k minor faults per step measured), while SequentialMLP's per-expert gradients
are small enough for the C allocator to recycle: unfused, the grouped GEMM ran at 0.70x of
SequentialMLP under DDP, fused at 1.17x (benchmarks/grouped_gemm.py). ``--gemm-gradient-
accumulation-fusion`` (MindSpeed's flag) makes it a requirement: a weight without ``main_grad``
is logged once (an error under ``--strict``); ``--no-gemm-gradient-accumulation-fusion`` keeps
megatron's unfused gradient.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from mindspeed_like.toolkit.errors import FeatureUnsupported
from mindspeed_like.toolkit.fallback import Fallback
from mindspeed_like.toolkit.overrides import config_fields

NAME = "grouped-gemm"


class GroupedGemmUnsupported(FeatureUnsupported):
    """``strict`` is on and a grouped GEMM call cannot run as configured."""


def grouped_gemm_package_installed() -> bool:
    """Whether the CUDA ``grouped_gemm`` package megatron looks for is importable: a package
    (directory with ``ops``), not a stray single-file module of that name on ``sys.path`` such
    as ``benchmarks/grouped_gemm.py`` when a script in that directory runs."""
    spec = importlib.util.find_spec("grouped_gemm")
    return spec is not None and spec.submodule_search_locations is not None


@dataclass(frozen=True)
class GroupedGemmOps:
    """Stands in for ``grouped_gemm.ops`` (only ``gmm`` is used by megatron-core), backed by our kernel.

    accumulate_main_grad: ``"auto"`` (into ``main_grad`` where the weight has one), ``"on"``
        (``--gemm-gradient-accumulation-fusion``: also report a weight without it) or ``"off"``
        (``--no-gemm-gradient-accumulation-fusion``).
    """

    accumulate_main_grad: str
    fall_back: Fallback

    def gmm(self, a, b, batch_sizes, trans_b=False):
        """``grouped_gemm.ops.gmm``'s signature."""
        from mindspeed_like.kernels.backend import backend_for, force_backend
        from mindspeed_like.kernels.grouped_gemm import MAX_NPU_GROUPS, gmm, main_grad_owner

        owner = None
        if self.accumulate_main_grad != "off" and b.requires_grad:
            owner = main_grad_owner(b)
            if owner is None and self.accumulate_main_grad == "on":
                self.fall_back(
                    "--gemm-gradient-accumulation-fusion: the expert weight has no main_grad (not wrapped in "
                    "megatron's DistributedDataParallel); its gradient is computed normally"
                )
        if backend_for(a) == "npu" and b.shape[0] > MAX_NPU_GROUPS:
            self.fall_back(
                f"npu_grouped_matmul takes at most {MAX_NPU_GROUPS} groups; {b.shape[0]} experts use the portable loop"
            )
            with force_backend("portable"):
                return gmm(a, b, batch_sizes, trans_b, accumulate_into=owner)
        return gmm(a, b, batch_sizes, trans_b, accumulate_into=owner)

    def gmm_experts(self, a, weights, batch_sizes, trans_b=False):
        """``gmm(a, torch.stack(weights), ...)`` keeping no stacked copy for backward (per-expert
        parameters: SequentialMLP's on megatron-core 0.17+); no main_grad fusion (one per expert)."""
        from mindspeed_like.kernels.backend import backend_for, force_backend
        from mindspeed_like.kernels.grouped_gemm import MAX_NPU_GROUPS, gmm_experts

        if backend_for(a) == "npu" and len(weights) > MAX_NPU_GROUPS:
            self.fall_back(
                f"npu_grouped_matmul takes at most {MAX_NPU_GROUPS} groups; {len(weights)} experts use the portable "
                "loop"
            )
            with force_backend("portable"):
                return gmm_experts(a, weights, batch_sizes, trans_b)
        return gmm_experts(a, weights, batch_sizes, trans_b)


def ours_installed() -> bool:
    """Whether megatron's grouped GEMM is ours: ``grouped_gemm_util.ops`` is our op (megatron-core
    <0.17), or (0.17+, no grouped_gemm_util) our SequentialMLP wrapper is in place."""
    try:
        from megatron.core.transformer.moe import grouped_gemm_util as gg
    except ImportError:
        from megatron.core.transformer.moe.experts import SequentialMLP

        from mindspeed_like.engine import wrappers_of

        forward = SequentialMLP.__dict__.get("forward")
        return any(type(w).__name__ == "SequentialExpertsForward" for w in wrappers_of(forward))
    return isinstance(gg.ops, GroupedGemmOps)


def grouped_gemm_available() -> None:
    """Replaces ``assert_grouped_gemm_is_available``: our op is installed, nothing to assert."""


def grouped_mlp_forward(wrapped, instance, args, kwargs):
    """Wrapper of ``GroupedMLP.forward``: with our op, fp32/fp16 configs pass the bf16 assertion."""
    if instance is None or instance.config.bf16 or not ours_installed():
        return wrapped(*args, **kwargs)
    with config_fields(instance, bf16=True):
        return wrapped(*args, **kwargs)


_notes = Fallback(NAME, strict=False)  # informational lines only (never raises)


@contextlib.contextmanager
def capability_check_hidden(args) -> Iterator[None]:
    """validate_args hook: Megatron-LM's CUDA compute-capability check for --moe-grouped-gemm is
    skipped while our op is installed (the CUTLASS kernels it guards are not used)."""
    if not getattr(args, "moe_grouped_gemm", False) or not ours_installed():
        yield
        return
    _notes.once(
        "capability",
        "grouped-gemm: Megatron-LM's GroupedGEMM compute-capability check skipped (the kernel is ours)",
        logging.INFO,
    )
    args.moe_grouped_gemm = False
    try:
        yield
    finally:
        args.moe_grouped_gemm = True
