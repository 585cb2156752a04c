"""flash-attention (``--use-flash-attn``, megatron's and MindSpeed's spelling): megatron-core's
local-spec core attention without the s x s score matrix (torch_npu's ``npu_fusion_attention`` on
NPU, torch SDPA elsewhere), with MindSpeed's ``--sparse-mode``, ``--pre-tockens`` and
``--next-tockens``. Target, semantics and coverage: ``forward.py``."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.flash_attention.forward import (
    CausalShape,
    FlashAttentionForward,
    FlashAttentionUnsupported,
)
from mindspeed_like.toolkit.declaration import Context, Feature, Flag, kernel_backend
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.targets import DOT_PRODUCT_ATTENTION

NAME = "flash-attention"
SPARSE_MODES = (0, 2, 3, 4)


def patches(ctx: Context) -> list[Patch]:
    shape = CausalShape(ctx["sparse_mode"], ctx["pre_tockens"], ctx["next_tockens"])
    forward = FlashAttentionForward(
        shape,
        ctx.fallback(NAME, FlashAttentionUnsupported, "using megatron's DotProductAttention"),
        pad_value_head=not ctx["mla_fa_without_pad"],
    )
    return [
        Patch(
            f"{DOT_PRODUCT_ATTENTION}.DotProductAttention.forward",
            Kind.WRAP,
            forward,
            why="local-spec core attention: fused flash kernel instead of the [b, n, sq, sk] scores and probs",
        ),
    ]


def validate(ctx: Context) -> None:
    mode = ctx["sparse_mode"]
    if mode not in SPARSE_MODES:
        raise ConfigError(
            f"--sparse-mode {mode} is not supported: use 0 (causal, at most --pre-tockens keys back), "
            "2 (causal anchored top-left), 3 (causal anchored bottom-right) or 4 (band of --pre-tockens back and "
            "--next-tockens ahead, anchored bottom-right). Mode 1 (explicit mask) is chosen automatically when "
            "megatron passes a padding/arbitrary mask; prefix and varlen-split modes 5-8 are not supported"
        )
    for name in ("pre_tockens", "next_tockens"):
        if ctx[name] < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {ctx[name]}")
    if mode in (2, 3):
        given = [n for n in ("pre_tockens", "next_tockens") if ctx.config.sources.get(n, "default") != "default"]
        if given:
            raise ConfigError(
                f"--sparse-mode {mode} ignores {', '.join('--' + n.replace('_', '-') for n in given)} "
                "(as torch_npu does); use --sparse-mode 0 or 4 for a band"
            )


FEATURE = Feature(
    name=NAME,
    summary="core attention without the s x s score matrix (torch_npu.npu_fusion_attention on NPU, SDPA elsewhere)",
    patches=patches,
    flags=(
        Flag(
            "use_flash_attn",
            bool,
            False,
            "compute megatron's local-spec core attention (DotProductAttention) with a flash kernel "
            "(torch_npu.npu_fusion_attention on NPU, torch scaled_dot_product_attention elsewhere)",
            megatron_defines=True,
        ),
        Flag(
            "sparse_mode",
            int,
            0,
            "flash attention, causal layers: 0 = causal keeping at most --pre-tockens keys back; 2 / 3 = causal "
            "anchored top-left / bottom-right (differ only when q and k lengths differ); 4 = band of --pre-tockens "
            "back and --next-tockens ahead, anchored bottom-right (sliding window)",
        ),
        Flag("pre_tockens", int, 65536, "flash attention, causal layers: keys visible before the diagonal"),
        Flag("next_tockens", int, 0, "flash attention, --sparse-mode 4: keys visible after the diagonal"),
        Flag(
            "mla_fa_without_pad",
            bool,
            False,
            "flash attention, multi-latent attention on CPU (V head dim != q/k's): run the unpadded blocked kernel "
            "instead of zero-padding to one head dim for torch's fused flash kernel (faster, the default); NPU "
            "never pads (npu_fusion_attention takes the two head dims)",
        ),
    ),
    backend=kernel_backend,
    validate=validate,
    switch_on={"use_flash_attn": True},
    optimization_level=1,
)

__all__ = ["FEATURE", "FlashAttentionUnsupported"]
