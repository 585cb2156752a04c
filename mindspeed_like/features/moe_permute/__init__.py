"""moe-permute (``--use-fused-moe-token-permute-and-unpermute``, MindSpeed's spelling; also
megatron's ``--moe-permute-fusion``): MoE token permute / unpermute / chunk sort as single
autograd Functions that save indices only, bitwise equal to megatron's unfused path in fp32
(torch_npu's ``npu_moe_token_permute`` / ``npu_moe_token_unpermute`` on NPU). Also provides the
TransformerEngine names megatron requires for ``moe_permute_fusion=True``, so that config is
accepted without TE. Targets and why: ``dispatch.py``."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.moe_permute.dispatch import (
    TE_FUNCTIONS,
    ConfigPostInit,
    PermuteWrapper,
    SortChunksWrapper,
    UnpermuteWrapper,
)
from mindspeed_like.toolkit.declaration import Context, Feature, Flag, kernel_backend
from mindspeed_like.toolkit.targets import MOE_UTILS, TE_EXTENSION, TRANSFORMER_CONFIG

NAME = "moe-permute"


def patches(ctx: Context) -> list[Patch]:
    # One layout for 0.13-0.19: the three functions and the five TE names live in the same
    # modules in every supported release; the signature differences (0.19's extra arguments and
    # 5-value permute) are read per call from the installed signature (dispatch.py).
    result = [
        Patch(
            f"{MOE_UTILS}.permute",
            Kind.WRAP,
            PermuteWrapper(fixed_count=ctx.megatron_at_least("0.19")),
            why="every token dispatcher permutes through it (fused=True: TE names unbound without TE)",
        ),
        Patch(
            f"{MOE_UTILS}.unpermute",
            Kind.WRAP,
            UnpermuteWrapper(ctx.fallback(NAME)),
            why="every token dispatcher unpermutes through it",
        ),
        Patch(
            f"{MOE_UTILS}.sort_chunks_by_idxs",
            Kind.WRAP,
            SortChunksWrapper(),
            why="alltoall dispatcher's local-expert chunk sort",
        ),
    ]
    result.append(
        Patch(
            f"{TRANSFORMER_CONFIG}.TransformerConfig.__post_init__",
            Kind.WRAP,
            ConfigPostInit(),
            why="moe_permute_fusion's check imports TE's names from moe_utils (absent without TE): skipped",
            after=("te-backend",),
            counts_as_reached=False,  # runs for every model, MoE or not
        )
    )
    result += [
        Patch(
            f"{TE_EXTENSION}.{name}",
            Kind.REPLACE,
            function,
            update_aliases=False,  # None without TE: other modules' None must stay None
            why="TransformerConfig.__post_init__ requires it for moe_permute_fusion (None without TE)",
        )
        for name, function in TE_FUNCTIONS.items()
    ]
    return result


def enabled(ctx: Context) -> bool:
    return bool(ctx["use_fused_moe_token_permute_and_unpermute"] or ctx["moe_permute_fusion"])


FEATURE = Feature(
    name=NAME,
    summary="MoE token permute/unpermute as single autograd functions saving indices, bitwise megatron's "
    "unfused path (torch_npu.npu_moe_token_permute/unpermute on NPU); moe_permute_fusion without TE",
    patches=patches,
    flags=(
        Flag(
            "use_fused_moe_token_permute_and_unpermute",
            bool,
            False,
            "run megatron's MoE token permute / unpermute / chunk sort (every dispatcher, fused or not) as "
            "single autograd functions that save only indices (torch_npu's npu_moe_token_permute / "
            "npu_moe_token_unpermute on NPU); also lets moe_permute_fusion=True work without TransformerEngine",
        ),
        Flag(
            "moe_permute_fusion",
            bool,
            False,
            "megatron's --moe-permute-fusion: switches this feature on (TransformerEngine's fused permute names "
            "are provided by mindspeed_like's kernel)",
            megatron_defines=True,
        ),
    ),
    enabled=enabled,
    backend=kernel_backend,
    switched_by="--use-fused-moe-token-permute-and-unpermute or --moe-permute-fusion",
    switch_on={"use_fused_moe_token_permute_and_unpermute": True},
    optimization_level=1,
)

__all__ = ["FEATURE", "NAME"]
