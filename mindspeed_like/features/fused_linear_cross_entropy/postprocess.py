"""fused-linear-cross-entropy's mechanism: GPTModel's output layer and loss as one chunked call.

Target: ``megatron.core.models.gpt.gpt_model.GPTModel._postprocess`` (WRAP), the one method that
sees the final hidden states, the labels and the output layer together (0.13-0.19). Wrapping the
output layer alone cannot know whether a loss follows; wrapping the loss alone is too late (the
logits exist). For a call with labels, on the stage that has the output layer, what megatron
does there (``output_layer(hidden, weight=...)`` then ``compute_language_model_loss``) is
replaced by :func:`mindspeed_like.kernels.linear_cross_entropy.linear_cross_entropy` on the same
weight (the embedding's when ``share_embeddings_and_output_weights``), after megatron's own input
mapping of the output layer: the sequence-parallel all-gather (reduce-scatter in backward) or the
TP copy (all-reduce of ``d hidden`` in backward). The per-token loss comes back ``[b, s]`` as
megatron's does; the caller's loss mask and reduction are untouched.

Handed back to megatron (one log line per reason; an error under ``strict``): multi-token
prediction heads, inference contexts, gathered logits (``gather_output`` /
``runtime_gather_output``), an ``output_processor`` (0.19), an output-layer bias, deferred
embedding wgrad (``defer_embedding_wgrad_compute``) and the config logger (it records the logits).
Calls without labels (logits returned) are megatron's own, silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mindspeed_like.kernels.linear_cross_entropy import linear_cross_entropy
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.errors import FeatureUnsupported
from mindspeed_like.toolkit.fallback import Fallback


class FusedLinearCrossEntropyUnsupported(FeatureUnsupported):
    """A GPTModel call the fused output layer + loss cannot take (handed back to megatron)."""


def _unsupported(model: Any, call: Call) -> str | None:
    config, layer = model.config, model.output_layer
    if getattr(config, "mtp_num_layers", None) or call.get("mtp_in_postprocess"):
        return "multi-token prediction heads (mtp_num_layers) compute their own logits"
    if call.get("inference_context") is not None or call.get("inference_params") is not None:
        return "an inference context"
    if call.get("runtime_gather_output") or getattr(layer, "gather_output", False):
        return "gathered logits requested (gather_output / runtime_gather_output)"
    if call.get("output_processor") is not None:
        return "an output_processor"
    if getattr(layer, "bias", None) is not None:
        return "an output layer with a bias"
    if getattr(config, "defer_embedding_wgrad_compute", False):
        return "defer_embedding_wgrad_compute (the output layer's deferred weight gradient)"
    from megatron.core.config_logger import has_config_logger_enabled

    if has_config_logger_enabled(config):
        return "the config logger records the logits"
    return None


def _tp_group(layer: Any):
    group = getattr(layer, "tp_group", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def fused_output_loss(model: Any, hidden_states: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Per-token loss ``[b, s]`` of GPTModel's output layer on ``hidden_states [s, b, h]``."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    layer = model.output_layer
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else layer.weight
    group = _tp_group(layer)
    tp_size = dist.get_world_size(group) if dist.is_initialized() else 1
    if getattr(layer, "sequence_parallel", False):
        hidden_states = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=True, group=group
        )
    elif tp_size > 1:
        hidden_states = copy_to_tensor_model_parallel_region(hidden_states, group=group)
    tp_rank = dist.get_rank(group) if tp_size > 1 else 0
    loss = linear_cross_entropy(
        hidden_states,
        weight,
        labels.transpose(0, 1),  # [b, s] -> [s, b], the hidden states' order
        chunk_tokens=chunk_tokens,
        vocab_start=tp_rank * weight.shape[0],
        tp_group=group if tp_size > 1 else None,
        accumulation_fusion=bool(getattr(layer, "gradient_accumulation_fusion", False)),
    )
    return loss.transpose(0, 1).contiguous()


@dataclass(frozen=True)
class FusedPostprocess:
    """Wrapper of ``GPTModel._postprocess``."""

    chunk_tokens: int
    fall_back: Fallback

    def __call__(self, wrapped, instance, args, kwargs):
        call = Call(wrapped, args, kwargs)
        labels = call.get("labels")
        if labels is None or not instance.post_process:
            return wrapped(*args, **kwargs)
        reason = _unsupported(instance, call)
        if reason is not None:
            self.fall_back(reason)
            return wrapped(*args, **kwargs)
        return fused_output_loss(instance, call["hidden_states"], labels, self.chunk_tokens)
