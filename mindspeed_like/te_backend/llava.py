"""LLaVA's sequence and context parallelism on the te-backend's attention.

megatron's ``LLaVAModel.__init__`` (``models/multimodal/llava_model.py``, 0.13-0.19) allows sequence
or context parallelism in its language model only when that model's core attention is
``TEDotProductAttention`` *and* the module's ``HAVE_TE`` is true, and for context parallelism asks
``is_te_min_version("1.10.0")``. Both come from the module's ``try: import transformer_engine``, so
without TE ``HAVE_TE`` is False (and ``is_te_min_version`` unbound in 0.13-0.16; megatron.core.utils'
in 0.17+, which imports TE and fails) even though the te-backend binds ``TEDotProductAttention``
there and its attention runs every context-parallel algorithm: "Sequence/Context Parallelism is
supported only with TE DotProductAttention" for a spec that uses it (4 cases of megatron's
``test_llava_model.py::TestLLaVAModelTokenParallel`` at 8 ranks, and every LLaVA run with
``--sequence-parallel`` or ``--context-parallel-size`` on the TE spec).

The te-backend keeps ``HAVE_TE`` False everywhere else (no TE optimizer, no fp8), so here it is true
only while ``LLaVAModel.__init__`` runs, with ``is_te_min_version`` answering for the TE layer API the
backend implements (``versions.py``); the identity check against ``TEDotProductAttention`` stays
megatron's (a local spec is still refused). Packed (thd) context parallelism in ``forward`` needs TE's
``thd_get_partitioned_indices`` (``HAVE_TEX``), which stays unavailable: megatron's own assertion.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from mindspeed_like.toolkit.overrides import attributes_set

LLAVA = "megatron.core.models.multimodal.llava_model"


@dataclass(frozen=True)
class TEAttentionAllowsParallelism:
    """Wrapper of ``LLaVAModel.__init__``."""

    def __call__(self, wrapped, instance, args: tuple, kwargs: dict) -> Any:
        from mindspeed_like.te_backend.versions import te_layers_min_version

        with attributes_set(sys.modules[LLAVA], HAVE_TE=True, is_te_min_version=te_layers_min_version):
            return wrapped(*args, **kwargs)
