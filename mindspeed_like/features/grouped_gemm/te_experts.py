"""grouped-gemm on the TE spec's grouped experts (``TEGroupedMLP``).

megatron's TE spec builds ``TEGroupedMLP`` for ``moe_grouped_gemm=True``: its fc1/fc2 are TE
``GroupedLinear``s, which the te-backend (no TransformerEngine installed) computes with this
feature's grouped-GEMM kernel (``kernels.grouped_gemm.gmm``). There is nothing left for this
feature to replace, but a user who passed ``--moe-grouped-gemm`` should read in the report that
the experts ran as grouped GEMMs, and by whom, not "on but never reached".

Target: ``megatron.core.transformer.moe.experts.TEGroupedMLP.forward`` (WRAP): the one call per
layer of the TE spec's grouped experts. The wrapper records "served by te-backend" once (only
when the te-backend's grouped linears are what the module holds: with a real TransformerEngine
TE computes them, and nothing is said) and calls megatron's forward unchanged. The line is said by
rank 0 only: every rank builds the same experts, and a Megatron-LM run at EP/TP/CP=2 printed it once
per process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindspeed_like.toolkit.fallback import Fallback


def _on_te_backend(module) -> bool:
    return type(getattr(module, "linear_fc1", None)).__module__.startswith("mindspeed_like.te_backend")


def _rank_zero() -> bool:
    distributed = torch.distributed
    return not (distributed.is_available() and distributed.is_initialized()) or distributed.get_rank() == 0


@dataclass(frozen=True)
class TEGroupedExpertsServed:
    """Wrapper of ``TEGroupedMLP.forward``: records that the te-backend's grouped linears ran it."""

    fall_back: Fallback

    def __call__(self, wrapped, instance, args, kwargs):
        if instance is not None and _on_te_backend(instance):
            self.fall_back.served_by(
                "te-backend",
                "grouped-gemm: the TE spec's grouped experts (TEGroupedMLP) run each linear as one grouped GEMM in "
                "the te-backend's grouped linears (the same kernel); grouped-gemm's own patches act on the local "
                "spec's experts",
                say=_rank_zero(),
            )
        return wrapped(*args, **kwargs)
