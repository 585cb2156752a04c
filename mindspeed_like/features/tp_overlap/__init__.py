"""tp-overlap (``--use-tiled-tp-overlap`` / ``--use-ascend-coc``, ``--use-fused-tp-comm-matmul`` /
``--use-ascend-mc2``): column/row-parallel linears overlap their tensor-parallel collective with the
matmul tile by tile (MC2 fused kernels on NPU). Targets and fallbacks: ``linears.py``."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.tp_overlap.linears import (
    FEATURE_NAME,
    ColumnParallelLinear,
    Overlap,
    RowParallelForward,
    TpOverlapUnsupported,
)
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.targets import TP_LAYERS

CHUNK_CHOICES = (1, 2, 4, 8)


def patches(ctx: Context) -> list[Patch]:
    overlap = Overlap(
        tiles=ctx["tiled_tp_overlap_chunks"] if ctx["use_tiled_tp_overlap"] else None,
        mc2=bool(ctx["use_fused_tp_comm_matmul"]),
        fall_back=ctx.fallback(FEATURE_NAME, TpOverlapUnsupported),
    )
    return [
        Patch(
            f"{TP_LAYERS}.linear_with_grad_accumulation_and_async_allreduce",
            Kind.WRAP,
            ColumnParallelLinear(overlap),
            why="column-parallel matmul with its SP all-gather / dgrad reduce-scatter / all-reduce: tiled overlap",
        ),
        Patch(
            f"{TP_LAYERS}.RowParallelLinear.forward",
            Kind.WRAP,
            RowParallelForward(overlap),
            why="row-parallel matmul + its reduce-scatter / all-reduce (done after the Function, in forward): tiled",
        ),
    ]


def validate(ctx: Context) -> None:
    if ctx["use_fused_tp_comm_matmul"] and ctx.strict and ctx.kernel_backend != "npu":
        raise ConfigError(
            "use_fused_tp_comm_matmul (--use-ascend-mc2) needs an Ascend NPU with torch_npu (device resolves to "
            f"{ctx.device!r}); drop the flag, or use --use-tiled-tp-overlap which works on any device"
        )


FEATURE = Feature(
    name=FEATURE_NAME,
    summary="tensor-parallel linears overlap their all-gather / reduce-scatter / all-reduce with the matmul "
    "tile by tile (MC2 fused kernels on NPU)",
    patches=patches,
    flags=(
        Flag(
            "use_tiled_tp_overlap",
            bool,
            False,
            "cut the token rows of ColumnParallelLinear / RowParallelLinear into tiles and run each tile's "
            "tensor-parallel collective under another tile's matmul (any device)",
            aliases=("--use-ascend-coc",),
        ),
        Flag(
            "tiled_tp_overlap_chunks",
            int,
            4,
            "number of tiles per tensor-parallel linear (1 means megatron's serial path)",
            aliases=("--coc-parallel-num",),
            choices=CHUNK_CHOICES,
        ),
        Flag(
            "use_fused_tp_comm_matmul",
            bool,
            False,
            "on an Ascend NPU, run sequence-parallel linears as torch_npu's fused all-gather+matmul / "
            "matmul+reduce-scatter kernels (MC2)",
            aliases=("--use-ascend-mc2",),
        ),
    ),
    enabled=lambda ctx: bool(ctx["use_tiled_tp_overlap"] or ctx["use_fused_tp_comm_matmul"]),
    backend=lambda ctx: "npu" if ctx["use_fused_tp_comm_matmul"] and ctx.kernel_backend == "npu" else "portable",
    validate=validate,
    switched_by="--use-tiled-tp-overlap / --use-fused-tp-comm-matmul",
    switch_on={"use_tiled_tp_overlap": True},
    optimization_level=1,
)

__all__ = ["FEATURE", "TpOverlapUnsupported"]
