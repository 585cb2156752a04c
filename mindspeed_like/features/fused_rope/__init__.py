"""fused-rotary-pos-emb (``--use-fused-rotary-pos-emb``, MindSpeed's flag): megatron's rotary
position embedding with shared cos/sin and a hand-written backward (``npu_rotary_mul`` on NPU).
Target and coverage: see ``dispatch.py``."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.fused_rope.dispatch import FusedRope, FusedRopeUnsupported
from mindspeed_like.toolkit.declaration import Context, Feature, Flag, kernel_backend
from mindspeed_like.toolkit.targets import ROPE_UTILS

NAME = "fused-rotary-pos-emb"


def patches(ctx: Context) -> list[Patch]:
    rope = FusedRope(
        ctx.fallback(NAME, FusedRopeUnsupported, "using megatron's apply_rotary_pos_emb"),
        per_token_thd_freqs=ctx.megatron_at_least("0.15"),
    )
    return [
        Patch(
            f"{ROPE_UTILS}.apply_rotary_pos_emb",
            Kind.WRAP,
            rope,
            why="megatron's RoPE dispatcher (sbhd/thd, used by Attention for q and k): fused rotation, shared cos/sin",
        ),
    ]


FEATURE = Feature(
    name=NAME,
    summary="rotary position embedding with shared cos/sin and a hand-written backward (npu_rotary_mul on NPU)",
    patches=patches,
    flags=(
        Flag(
            "use_fused_rotary_pos_emb",
            bool,
            False,
            "fused rotary position embedding (MindSpeed's flag; not megatron's TE-only --apply-rope-fusion)",
        ),
    ),
    backend=kernel_backend,
    switch_on={"use_fused_rotary_pos_emb": True},
    optimization_level=1,
)

__all__ = ["FEATURE", "FusedRopeUnsupported"]
