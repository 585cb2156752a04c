"""The TransformerEngine version megatron's spec code asks about, answered for this backend.

megatron's ``TESpecProvider`` picks modules by ``is_te_min_version`` (TENorm for q/k norms from
TE 1.9, TE linears for SequentialMLP experts from 1.7); without TE ``get_te_version()`` is None and
those comparisons raise. In the spec provider's module only (a module-local replacement), the
answer is for the TE layer contract this backend implements: :data:`TE_LAYERS_API`."""

from __future__ import annotations

from packaging.version import Version

TE_LAYERS_API = Version("2.1.0")
"""TE 2.x's megatron-facing layer contract: ``_extra_state`` as uint8 tensors, RMSNorm, GQA,
grouped linears (1.9+), separate K/V head dims (1.10+). 2.1, not 2.0: megatron-core 0.13-0.19 gate
nothing of the layer API on 2.1 (read from their source: only fp8, refused, and FusedAdam's
``store_param_remainders``, which the precision-aware feature's Adam implements and answers 2.1 for),
so one process answers one TE version; megatron's own tests gate the TE grouped GEMM on 2.1 (the
grouped linears here). Features of later TE releases that the spec code gates on versions (op fuser,
activation ops) are refused by name instead."""


def te_layers_version() -> Version:
    return TE_LAYERS_API


def te_layers_min_version(version: str, check_equality: bool = True) -> bool:
    wanted = Version(version)
    return TE_LAYERS_API >= wanted if check_equality else TE_LAYERS_API > wanted
