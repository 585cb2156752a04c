"""context-parallel's mechanism: megatron's local-spec core attention at ``context_parallel_size > 1``.

Targets (WRAP, both on ``megatron.core.transformer.dot_product_attention.DotProductAttention``):
- ``__init__`` asserts ``context_parallel_size == 1`` ("Context parallelism is only supported by
  TEDotProductAttention!"), in every release 0.13-0.19. The constructor runs with a view of the
  config whose ``context_parallel_size`` is 1 (nothing else in it reads the field) and the real
  config is put back on the module.
- ``forward`` receives this rank's zigzag chunks of q/k/v (megatron's ``get_batch_on_this_cp_rank``
  split the batch, ``RotaryEmbedding`` rotated them at their global positions); at CP > 1 it runs
  the chosen algorithm of ``kernels/context_parallel`` on the CP group and returns
  ``[sq, b, heads * head_dim]`` as megatron's forward does. At CP == 1 the call is megatron's (or
  flash-attention's) untouched.

Megatron semantics kept: the net softmax scale (``softmax_scale`` times the softmax's own scale,
as flash-attention), causal for ``AttnMaskType.causal`` (a given mask of a causal layer is taken
as the causal mask), GQA groups unexpanded on the wire. Refused with the reason (megatron has no
CP path without TransformerEngine to hand back to): packed sequences (thd), an explicit padding or
arbitrary mask, attention bias, a sliding window, and softmax types other than vanilla. Attention
dropout while training is applied inside the blocks (kernels/attention_dropout.py), its
seed drawn from megatron's RNG tracker.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import wrapt

from mindspeed_like.features.context_parallel.groups import current_groups
from mindspeed_like.kernels.context_parallel import (
    AttentionDropout,
    CPGroup,
    allgather_kv_attention,
    hybrid_attention,
    ring_attention,
    ulysses_attention,
)
from mindspeed_like.toolkit.binding import Call, signature_of
from mindspeed_like.toolkit.errors import FeatureUnsupported
from mindspeed_like.toolkit.fallback import Fallback
from mindspeed_like.toolkit.overrides import with_fields

ALGORITHMS = {
    "megatron_cp_algo": ring_attention,
    "ulysses_cp_algo": ulysses_attention,
    "kvallgather_cp_algo": allgather_kv_attention,
}


class ContextParallelUnsupported(FeatureUnsupported):
    """A call context-parallel attention cannot compute (and megatron cannot without TE)."""


def cp_size_of(config) -> int:
    return int(getattr(config, "context_parallel_size", 1) or 1)


@functools.lru_cache(maxsize=64)
def _signature_without_self(function):
    """A stand-in callable with ``function``'s signature minus its ``self`` (never called). Under
    another feature's wrapper the partial's target may already be bound (its signature starts at
    ``query``): dropping its first parameter regardless bound the call one argument off ("multiple
    values for argument 'attn_mask_type'", megatron's MTP tests at CP=2, level 1)."""
    signature = signature_of(function)
    parameters = list(signature.parameters.values())
    if parameters and parameters[0].name == "self":
        parameters = parameters[1:]

    def stand_in(*args, **kwargs):  # pragma: no cover - only its signature is read
        raise AssertionError("signature stand-in")

    stand_in.__signature__ = signature.replace(parameters=parameters)
    return stand_in


def bind(wrapped, args: tuple, kwargs: dict) -> Call:
    """``Call(wrapped, args, kwargs)``, also for a method called through its class
    (``DotProductAttention.__init__(self, ...)`` / ``.forward(self, ...)``, as subclasses do, e.g.
    te_backend's TEDotProductAttention): wrapt then hands the wrapper a partial holding the instance,
    whose signature still starts with ``self`` (binding ``args`` to it would shift them by one)."""
    if isinstance(wrapped, wrapt.PartialCallableObjectProxy):
        call = Call(_signature_without_self(wrapped.__wrapped__), args, kwargs)
        call.wrapped = wrapped  # calls go through the partial (it passes the instance)
        return call
    return Call(wrapped, args, kwargs)


def construct(wrapped, instance, args, kwargs):
    """``DotProductAttention.__init__`` past its CP assertion, the real config kept. A call megatron's
    signature does not take goes to megatron as it is, so its own TypeError names the argument
    (not this wrapper)."""
    try:
        call = bind(wrapped, args, kwargs)
    except TypeError:
        return wrapped(*args, **kwargs)
    config = call["config"]
    if cp_size_of(config) <= 1:
        return wrapped(*args, **kwargs)
    result = call(config=with_fields(config, context_parallel_size=1))
    instance.config = config
    return result


def _cp_group(module) -> CPGroup:
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = getattr(getattr(module, "pg_collection", None), "cp", None)
    if group is not None:
        return CPGroup(group, tuple(dist.get_process_group_ranks(group)))
    return CPGroup(
        parallel_state.get_context_parallel_group(), tuple(parallel_state.get_context_parallel_global_ranks())
    )


def _hierarchical_groups(cp: CPGroup, degree: int) -> tuple[CPGroup, CPGroup]:
    """megatron's hierarchical CP groups [Ulysses (consecutive ranks), ring (strided)], built at
    ``initialize_model_parallel`` from the degree (groups.py)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    groups = current_groups(parallel_state)
    sizes = [dist.get_world_size(g) for g in groups]
    if sizes != [degree, cp.size // degree]:
        raise ContextParallelUnsupported(
            f"hybrid_cp_algo with --ulysses-degree-in-cp {degree} at CP={cp.size} needs megatron's hierarchical "
            f"context-parallel groups of sizes [{degree}, {cp.size // degree}] (found {sizes or 'none'}): they are "
            "built by initialize_model_parallel when mindspeed_like is configured with hybrid_cp_algo before it "
            "runs (import mindspeed_like.megatron_adaptor / configure() first), or pass "
            f"initialize_model_parallel(..., hierarchical_context_parallel_sizes=[{degree}, {cp.size // degree}])"
        )
    return tuple(CPGroup(g, tuple(dist.get_process_group_ranks(g))) for g in groups)


def _refusal(module, call: Call, causal: bool) -> str | None:
    if call.get("packed_seq_params") is not None:
        return "packed sequences (thd) with context parallelism are not supported; use padded sequences (sbhd)"
    if call.get("attention_bias") is not None:
        return "attention bias"
    if call.get("attention_mask") is not None and not causal:
        return "an explicit padding/arbitrary attention mask (only causal or no mask)"
    if getattr(module.scale_mask_softmax, "window_size", None) is not None:
        return "a sliding window (config.window_size)"
    if getattr(module.config, "softmax_type", "vanilla") != "vanilla":
        return f"softmax_type {module.config.softmax_type!r}"
    return None


def _dropout(module, q) -> AttentionDropout | None:
    """Attention dropout while training: the masks' seed drawn from megatron's RNG tracker (forked
    unless sequence parallel, as megatron's own attention dropout), so ``--seed``, the TP ranks and
    recompute's RNG replay govern it; the masks themselves differ from megatron's bit for bit."""
    import contextlib

    p = float(module.attention_dropout.p) if module.attention_dropout.training else 0.0
    if p <= 0.0:
        return None
    fork = contextlib.nullcontext()
    if not module.config.sequence_parallel:
        from megatron.core import tensor_parallel

        fork = tensor_parallel.get_cuda_rng_tracker().fork()
    with fork:
        return AttentionDropout.draw(p, q.device)


NAME = "context-parallel"


def flash_at_cp_message(cp_size: int, algorithm: str) -> str:
    """What ``--use-flash-attn`` does at CP > 1, for the log and Megatron-LM's start-up lines."""
    return (
        f"flash-attention: at context_parallel_size {cp_size} the context-parallel kernel ({algorithm}) computes "
        "attention, flash-style (blockwise with an online softmax: no s x s score matrix is kept); "
        "--use-flash-attn's own kernel and its knobs (--sparse-mode, --pre-tockens/--next-tockens) act at CP=1"
    )


@dataclass(frozen=True)
class ContextParallelForward:
    """Wrapper of ``DotProductAttention.forward``."""

    algorithm: str
    ulysses_degree: int | None = None
    flash_attention: Fallback | None = None  # flash-attention is on: its calls are ours at CP > 1, said once

    def __call__(self, wrapped, instance, args, kwargs):
        cp_size = cp_size_of(instance.config)
        if cp_size <= 1:
            return wrapped(*args, **kwargs)
        if self.flash_attention is not None:
            self.flash_attention.served_by(NAME, flash_at_cp_message(cp_size, self.algorithm))
        from megatron.core.transformer.enums import AttnMaskType

        call = bind(wrapped, args, kwargs)
        mask_type = call.get("attn_mask_type") or instance.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        reason = _refusal(instance, call, causal)
        if reason is not None:
            raise ContextParallelUnsupported(
                f"context-parallel attention (CP={cp_size_of(instance.config)}) cannot compute this call: {reason}"
            )
        query, key, value = call["query"], call["key"], call["value"]
        sq, b = query.shape[:2]
        if sq % 2:
            raise ContextParallelUnsupported(
                f"context-parallel attention expects megatron's two zigzag chunks per rank; got {sq} local tokens"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        scale = instance.softmax_scale * (instance.scale_mask_softmax.scale or 1.0)
        cp = _cp_group(instance)
        dropout = _dropout(instance, q)
        if self.algorithm == "hybrid_cp_algo":
            if cp.size % self.ulysses_degree:
                raise ContextParallelUnsupported(
                    f"--ulysses-degree-in-cp {self.ulysses_degree} does not divide the context-parallel size {cp.size}"
                )
            inner, outer = _hierarchical_groups(cp, self.ulysses_degree)
            out = hybrid_attention(q, k, v, inner, outer, causal=causal, scale=scale, dropout=dropout)
        else:
            out = ALGORITHMS[self.algorithm](q, k, v, cp, causal=causal, scale=scale, dropout=dropout)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
