"""fused-linear-cross-entropy (``--use-fused-linear-cross-entropy``): GPTModel's output layer and
loss computed chunk by chunk over tokens, so the ``[tokens, vocab/TP]`` logits never exist.
Target and coverage: ``postprocess.py``; the kernel: ``kernels/linear_cross_entropy.py``."""

from __future__ import annotations

from mindspeed_like.engine import Kind, Patch
from mindspeed_like.features.fused_linear_cross_entropy.postprocess import (
    ChunkedAcceptanceCounts,
    DeferOutputLayer,
    FusedDeferredLoss,
    FusedLinearCrossEntropyUnsupported,
    FusedPostprocess,
)
from mindspeed_like.toolkit.declaration import Context, Feature, Flag
from mindspeed_like.toolkit.errors import ConfigError
from mindspeed_like.toolkit.targets import CORE, GPT_MODEL, LANGUAGE_MODULE, TP_LAYERS

NAME = "fused-linear-cross-entropy"


def patches(ctx: Context) -> list[Patch]:
    fall_back = ctx.fallback(NAME, FusedLinearCrossEntropyUnsupported, "using megatron's output layer and loss")
    return [
        Patch(
            f"{GPT_MODEL}.GPTModel._postprocess",
            Kind.WRAP,
            FusedPostprocess(ctx["linear_cross_entropy_chunk_tokens"], fall_back),
            why="the one method that sees the hidden states, the labels and the output layer together",
        ),
        # multi-token prediction: megatron's own _postprocess body runs with the output layer deferred
        Patch(
            f"{TP_LAYERS}.ColumnParallelLinear.forward",
            Kind.WRAP,
            DeferOutputLayer(),
            why="MTP models: inside _postprocess the model's output layer returns its input, not logits",
        ),
        Patch(
            f"{LANGUAGE_MODULE}.LanguageModule.compute_language_model_loss",
            Kind.WRAP,
            FusedDeferredLoss(),
            why="MTP models: the main and every head's loss from the deferred output layer, chunked",
        ),
        Patch(
            f"{CORE}.transformer.multi_token_prediction._compute_mtp_acceptance_counts",
            Kind.WRAP,
            ChunkedAcceptanceCounts(),
            versions=">=0.19",  # the MTP top-1 hit count (reads the heads' logits): not in 0.13-0.18.2
            why="MTP heads' top-1 hits counted on token chunks of the deferred logits",
        ),
    ]


def validate(ctx: Context) -> None:
    if ctx["linear_cross_entropy_chunk_tokens"] < 0:
        raise ConfigError(
            f"--linear-cross-entropy-chunk-tokens must be >= 0 (0: automatic), got "
            f"{ctx['linear_cross_entropy_chunk_tokens']}"
        )


FEATURE = Feature(
    name=NAME,
    summary="output layer + cross-entropy in token chunks: the [tokens, vocab/TP] logits never exist",
    patches=patches,
    flags=(
        Flag(
            "use_fused_linear_cross_entropy",
            bool,
            False,
            "compute GPTModel's output layer and loss chunk by chunk over tokens (training calls with labels): "
            "the [tokens, vocab/TP] logits and megatron's fp32 softmax are never stored",
        ),
        Flag(
            "linear_cross_entropy_chunk_tokens",
            int,
            0,
            "tokens per chunk of --use-fused-linear-cross-entropy; 0: as many as keep one chunk's fp32 logits "
            "within 64 MiB (64-8192)",
        ),
    ),
    validate=validate,
    backend="portable",
    switch_on={"use_fused_linear_cross_entropy": True},
    optimization_level=2,
)
