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

Multi-token prediction heads (``mtp_num_layers``): megatron computes each head's loss itself, in a
different place per release (0.13: ``MultiTokenPredictionBlock.forward``, handed ``output_layer``
and ``compute_language_model_loss``; 0.16: a loop in ``GPTModel._postprocess``; 0.19:
``multi_token_prediction.process_mtp_loss``, handed the same two), always as
``mtp_logits, _ = output_layer(hidden, weight=...)`` then ``compute_language_model_loss(labels,
mtp_logits)``, between them the label/mask rolling, the loss logging and ``MTPLossAutoScaler`` that
must stay megatron's. So for such a model the wrapped ``_postprocess`` runs megatron's own body with
the output layer DEFERRED: inside the call, this model's output layer (``ColumnParallelLinear.forward``,
WRAP, checked by identity) returns a :class:`DeferredLogits` (its input and weight, nothing
computed), and ``LanguageModule.compute_language_model_loss`` (WRAP) turns a ``DeferredLogits`` into
the chunked loss. The main loss takes the same route. 0.19 (not 0.17.1 or 0.18.2) also counts the heads' top-1 hits from
the logits (``_compute_mtp_acceptance_counts``, no grad, WRAP): for a ``DeferredLogits`` it runs
megatron's count on token chunks of the logits (never all at once) and sums.

MuP (``use_mup``, 0.17+) multiplies the logits by ``mup_output_mult`` (``LanguageModule._scale_logits``)
between the output layer and the loss, for the main loss and each MTP head. A logit scale is a scale
of the hidden states fed to the same matmul, so the kernel takes ``hidden * mult``: the non-MTP path
reads the config's multiplier, and a :class:`DeferredLogits` multiplied by a number (what
``_scale_logits`` does to it) carries the factor to the loss.

Handed back to megatron (one log line per reason; an error under ``strict``): inference contexts,
gathered logits (``gather_output`` /
``runtime_gather_output``), an ``output_processor`` (0.19), an output-layer bias, deferred
embedding wgrad (``defer_embedding_wgrad_compute``) and the config logger (it records the logits).
Calls without labels (logits returned) are megatron's own, silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mindspeed_like.kernels.linear_cross_entropy import auto_chunk_tokens, linear_cross_entropy
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.dtensors import is_dtensor
from mindspeed_like.toolkit.errors import FeatureUnsupported
from mindspeed_like.toolkit.fallback import Fallback


class FusedLinearCrossEntropyUnsupported(FeatureUnsupported):
    """A GPTModel call the fused output layer + loss cannot take (handed back to megatron)."""


def _unsupported(model: Any, call: Call) -> str | None:
    config, layer = model.config, model.output_layer
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
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    if is_dtensor(model.shared_embedding_or_output_weight() if tied else getattr(layer, "weight", None)):
        return (
            "torch FSDP2 shards the output layer: its weight is all-gathered by the layer's own forward, "
            "which the fused loss does not run"
        )
    return None


def _tp_group(layer: Any):
    group = getattr(layer, "tp_group", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def mup_logit_scale(config: Any) -> float:
    """The factor megatron's ``LanguageModule._scale_logits`` applies to the logits (1.0 without MuP)."""
    if getattr(config, "use_mup", False):
        return float(getattr(config, "mup_output_mult", 1.0))
    return 1.0


def fused_output_loss(
    model: Any,
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    weight: torch.Tensor | None = None,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """Per-token loss ``[b, s]`` of GPTModel's output layer on ``hidden_states [s, b, h]``
    (``weight``: the one megatron passes the output layer; default: the model's output weight),
    with the logits multiplied by ``logit_scale`` (MuP) before the softmax."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    layer = model.output_layer
    if weight is None:
        weight = (
            model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else layer.weight
        )
    group = _tp_group(layer)
    tp_size = dist.get_world_size(group) if dist.is_initialized() else 1
    if logit_scale != 1.0:
        hidden_states = hidden_states * logit_scale  # (h * m) W^T = m (h W^T); before the gather: fewer rows
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
class DeferredLogits:
    """What the output layer returns inside a deferred ``_postprocess`` (models with MTP heads)
    instead of ``[s, b, vocab/TP]`` logits: its input and the weight megatron passed it. Only
    ``compute_language_model_loss`` and 0.19's acceptance count take it (see the module docstring)."""

    hidden_states: torch.Tensor
    weight: torch.Tensor
    model: Any
    chunk_tokens: int
    scale: float = 1.0

    def __mul__(self, factor: object) -> DeferredLogits:
        """``logits * mup_output_mult`` (megatron's ``_scale_logits``): the factor goes with the call."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            return NotImplemented
        return dataclasses.replace(self, scale=self.scale * float(factor))

    __rmul__ = __mul__


@dataclass(frozen=True)
class _Deferring:
    layer: Any
    model: Any
    chunk_tokens: int


_DEFERRING: contextvars.ContextVar[_Deferring | None] = contextvars.ContextVar(
    "mindspeed_like_fused_linear_cross_entropy_deferring", default=None
)


@contextlib.contextmanager
def deferred_output_layer(model: Any, chunk_tokens: int) -> Iterator[None]:
    """Within: ``model.output_layer`` returns :class:`DeferredLogits`."""
    token = _DEFERRING.set(_Deferring(model.output_layer, model, chunk_tokens))
    try:
        yield
    finally:
        _DEFERRING.reset(token)


@dataclass(frozen=True)
class DeferOutputLayer:
    """Wrapper of ``ColumnParallelLinear.forward``: the deferred model's output layer (by identity)
    returns ``(DeferredLogits, None)``; every other linear, and every call outside a deferred
    ``_postprocess``, is megatron's."""

    def __call__(self, wrapped, instance, args, kwargs):
        state = _DEFERRING.get()
        if state is None or instance is not state.layer:
            return wrapped(*args, **kwargs)
        call = Call(wrapped, args, kwargs)
        if call.get("runtime_gather_output"):
            return wrapped(*args, **kwargs)
        weight = call.get("weight")
        weight = instance.weight if weight is None else weight
        return DeferredLogits(call["input_"], weight, state.model, state.chunk_tokens), None


@dataclass(frozen=True)
class FusedDeferredLoss:
    """Wrapper of ``LanguageModule.compute_language_model_loss``: deferred logits -> the chunked loss."""

    def __call__(self, wrapped, instance, args, kwargs):
        call = Call(wrapped, args, kwargs)
        logits = call.get("logits")
        if not isinstance(logits, DeferredLogits):
            return wrapped(*args, **kwargs)
        return fused_output_loss(
            logits.model, logits.hidden_states, call["labels"], logits.chunk_tokens, logits.weight, logits.scale
        )


@dataclass(frozen=True)
class ChunkedAcceptanceCounts:
    """Wrapper of megatron-core 0.19's ``multi_token_prediction._compute_mtp_acceptance_counts``
    (no grad; correct/total top-1 hits of an MTP head): for :class:`DeferredLogits`, megatron's own
    count on token chunks of the logits (``[chunk/b, b, vocab/TP]`` at a time), summed."""

    def __call__(self, wrapped, instance, args, kwargs):
        call = Call(wrapped, args, kwargs)
        deferred = call.get("mtp_logits")
        if not isinstance(deferred, DeferredLogits):
            return wrapped(*args, **kwargs)
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        layer = deferred.model.output_layer
        with torch.no_grad():
            hidden = deferred.hidden_states
            if getattr(layer, "sequence_parallel", False):
                hidden = gather_from_sequence_parallel_region(hidden, group=_tp_group(layer))
            labels, mask = call["mtp_labels"], call["loss_mask"]
            vocab_local = deferred.weight.shape[0]
            tokens = deferred.chunk_tokens or auto_chunk_tokens(vocab_local, deferred.weight.device)
            step = max(1, tokens // max(1, hidden.shape[1]))
            correct = total = None
            for start in range(0, hidden.shape[0], step):
                logits = torch.matmul(hidden[start : start + step], deferred.weight.t())
                if deferred.scale != 1.0:
                    logits = logits * deferred.scale
                part = call(
                    mtp_logits=logits,
                    mtp_labels=labels[:, start : start + step],
                    loss_mask=mask[:, start : start + step],
                )
                correct = part[0] if correct is None else correct + part[0]
                total = part[1] if total is None else total + part[1]
        return correct, total


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
        if getattr(instance.config, "mtp_num_layers", None):
            # megatron's body (MTP label rolling, logging, loss scaling) with the output layer deferred
            with deferred_output_layer(instance, self.chunk_tokens):
                return wrapped(*args, **kwargs)
        return fused_output_loss(
            instance, call["hidden_states"], labels, self.chunk_tokens, logit_scale=mup_logit_scale(instance.config)
        )
