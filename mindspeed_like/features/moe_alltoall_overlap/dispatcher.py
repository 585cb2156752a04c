"""Where the pipeline (``pipeline.py``) enters megatron's alltoall dispatcher, and when it steps aside.

Targets, the same three roles in 0.13-0.19 (method names checked in 0.13.1, 0.16.1, 0.19.2):

- ``MoEAlltoAllTokenDispatcher.token_dispatch``: megatron's blocking dispatch all-to-all of the
  permuted tokens and probs. Wrapped: when the pipeline can run this call, it does megatron's
  ``before_ep_alltoall`` host sync point and hands the permuted tokens on unchanged, marking the
  dispatcher (the all-to-all moves into the experts' step, chunk by chunk).
- ``MoELayer.routed_experts_compute`` (from 0.15; ``experts_compute`` in 0.13-0.14, which also
  runs the shared experts): the one place that holds both the dispatcher and the experts, called with
  what ``token_dispatch`` returned. Wrapped: with the mark, it runs dispatch all-to-all ->
  experts -> combine all-to-all as the chunked pipeline instead of megatron's
  ``dispatch_postprocess`` -> experts -> ``combine_preprocess`` (at expert-TP 1 those are the
  sort of rows by local expert and its inverse, which the per-expert chunks make unnecessary).
- ``MoEAlltoAllTokenDispatcher.token_combine``: megatron's blocking combine all-to-all.
  Wrapped: after a pipelined call its rows have already come back; it returns them unchanged.

Everything before (router, ``dispatch_preprocess``: counts and permutation) and after
(``combine_postprocess``: unpermute) is megatron's own code.

Shared experts under megatron's ``moe_shared_expert_overlap`` (the dispatcher holds them): megatron
splits their forward over the dispatcher's methods (``pre_forward_comm`` in
``dispatch_preprocess``; ``linear_fc1_forward_and_act`` after the dispatch all-to-all, in
``dispatch_postprocess`` or, 0.19, ``token_dispatch``; ``linear_fc2_forward`` +
``post_forward_comm`` in ``combine_postprocess`` or, 0.19, ``token_combine``; ``get_output`` in
``combine_postprocess``) to run them on a second CUDA stream. The pipeline takes the calls it
replaces: fc1 and fc2 run as one piece under the in-flight dispatch all-to-alls (and their
backward under the gradient all-to-alls), from what ``pre_forward_comm`` cached; megatron's later
``linear_fc2_forward`` call is then a no-op (``shared_fc2_done``, a WRAP of
``SharedExpertMLP.linear_fc2_forward``), and where megatron's ``token_combine`` made the fc2 and
``post_forward_comm`` calls (0.19), the short-circuited ``token_combine`` makes them.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mindspeed_like.features.moe_alltoall_overlap.pipeline import ChunkPlan, SharedPart, overlapped_experts
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.errors import FeatureUnsupported
from mindspeed_like.toolkit.fallback import Fallback
from mindspeed_like.toolkit.recompute import whole_recompute

FEATURE_NAME = "moe-alltoall-overlap"
PENDING = "_mindspeed_like_a2a_overlap_pending"  # on the dispatcher: token_dispatch was deferred
COMBINED = "_mindspeed_like_a2a_overlap_combined"  # on the dispatcher: token_combine has nothing to do
FC2_DONE = "_mindspeed_like_a2a_overlap_fc2_done"  # on the shared experts: the pipeline ran their fc2


class MoeAlltoAllOverlapUnsupported(FeatureUnsupported):
    """A dispatch the chunked all-to-all pipeline cannot take (raised under --strict)."""


def why_not(dispatcher: Any) -> str | None:
    """The reason this dispatcher's call keeps megatron's blocking all-to-alls, or None."""
    config = dispatcher.config
    if dispatcher.ep_size <= 1:
        return "expert_model_parallel_size is 1: there is no all-to-all to overlap"
    if dispatcher.tp_size > 1:
        return "expert_tensor_parallel_size > 1: the expert-TP all-gather / reduce-scatter stay megatron's"
    if dispatcher.num_local_experts < 2:
        return (
            "one expert per EP rank: the tokens are cut into one chunk per local expert, so there is nothing "
            "to pipeline (use at least 2 experts per rank: num_moe_experts >= 2 * expert_model_parallel_size)"
        )
    if dispatcher.drop_and_pad:
        return "moe_pad_expert_input_to_capacity: padded capacity layouts keep megatron's path"
    if getattr(config, "gradient_accumulation_fusion", False):
        return "gradient_accumulation_fusion: the experts' fused wgrad into main_grad is not verified chunked"
    if getattr(config, "delay_wgrad_compute", False) or getattr(
        config, "overlap_dispatch_backward_with_experts_wgrad", False
    ):
        return "delayed expert wgrad (delay_wgrad_compute): megatron schedules those weight gradients itself"
    if getattr(config, "cuda_graph_impl", "none") not in ("none", None) or getattr(config, "enable_cuda_graph", False):
        return "CUDA graphs capture megatron's dispatcher as is"
    return None


def _async_all_to_all(group) -> Callable:
    def exchange(output: torch.Tensor, data: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        # looked up at call time: a simulated link (testing/simulated_alltoall_link.py) patches it
        return torch.distributed.all_to_all_single(
            output, data, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group, async_op=True
        )

    return exchange


def _counts(values: Any) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def plan_of(dispatcher: Any, rows: int) -> ChunkPlan:
    """This dispatch's chunk plan, from what megatron's ``preprocess`` computed."""
    local = dispatcher.routing_map.sum(dim=0).tolist()  # rows per global expert, as permute sorted them
    received = _counts(dispatcher.num_global_tokens_per_local_expert)  # [ep (x tp=1), local experts]
    plan = ChunkPlan.from_counts(local, received)
    if plan.local_rows != rows:
        raise RuntimeError(
            f"{FEATURE_NAME}: the routing map counts {plan.local_rows} permuted rows, the dispatcher produced {rows}"
        )
    expected = sum(_counts(dispatcher.output_splits))
    if sum(map(sum, plan.recv_counts)) != expected:
        raise RuntimeError(f"{FEATURE_NAME}: per-expert receive counts do not add up to megatron's output_splits")
    return plan


def _finish_dispatch_bookkeeping(dispatcher: Any) -> None:
    """What ``dispatch_postprocess`` does besides moving rows: its host sync points, then
    ``tokens_per_expert`` is cleared (the next call recomputes it)."""
    tokens = dispatcher._maybe_dtoh_and_synchronize("before_permutation_2", dispatcher.tokens_per_expert)
    dispatcher._maybe_dtoh_and_synchronize("before_finish", tokens)
    dispatcher.tokens_per_expert = None


def run_pipeline(layer: Any, tokens: torch.Tensor, probs: torch.Tensor, recompute: bool = False) -> torch.Tensor:
    """Dispatch all-to-all, experts, combine all-to-all of ``layer``, chunked per local expert
    (``recompute``: the experts' forward again in backward, moe-zero-memory)."""
    dispatcher = layer.token_dispatcher
    plan = plan_of(dispatcher, tokens.shape[0])
    _finish_dispatch_bookkeeping(dispatcher)
    experts = layer.experts
    local = dispatcher.num_local_experts

    def run_expert(e: int, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros(local, dtype=torch.long)
        counts[e] = x.shape[0]
        # with recompute, this chunk is already recomputed as a whole: moe-zero-memory's wrapper of the
        # experts module (and an activation-only recompute) step aside
        with whole_recompute() if recompute else contextlib.nullcontext():
            out, bias = experts(x, counts, p)
        if bias is not None:
            raise RuntimeError(f"mlp_bias is not supported for {type(dispatcher).__name__}")  # megatron's assert
        return out

    params = [p for p in experts.parameters() if p.requires_grad]
    exchange = _async_all_to_all(dispatcher.ep_group)
    shared_module = getattr(dispatcher, "shared_experts", None)
    if shared_module is None:
        out = overlapped_experts(plan, exchange, run_expert, tokens, probs, params, recompute=recompute)
    else:
        shared, shared_input = _shared_part(shared_module)
        out, shared_out = overlapped_experts(
            plan, exchange, run_expert, tokens, probs, params, recompute, shared, shared_input
        )
        shared_module.cached_fc2_output = shared_out  # what megatron's linear_fc2_forward leaves
        setattr(shared_module, FC2_DONE, True)
    setattr(dispatcher, COMBINED, True)
    return out


def _shared_part(shared: Any) -> tuple[SharedPart, torch.Tensor]:
    """megatron's overlapped shared experts (``moe_shared_expert_overlap``) as the pipeline's
    :class:`SharedPart`, on the input their ``pre_forward_comm`` cached."""
    shared_input = shared.cached_fc1_input
    if shared_input is None:
        raise RuntimeError(
            f"{FEATURE_NAME}: the shared experts have no cached input (megatron's dispatch_preprocess did not run "
            "their pre_forward_comm); switch the feature off"
        )

    def run(x: torch.Tensor) -> torch.Tensor:
        shared.cached_fc1_input = x
        shared.linear_fc1_forward_and_act()
        shared.linear_fc2_forward()
        y, shared.cached_fc2_output = shared.cached_fc2_output, None
        return y

    params = tuple(p for linear in (shared.linear_fc1, shared.linear_fc2) for p in linear.parameters())
    return SharedPart(run, params), shared_input


@functools.cache
def _combine_runs_shared_experts(dispatcher_type: type) -> bool:
    """Whether this megatron's ``token_combine`` (patches unwrapped) makes the overlapped shared
    experts' ``post_forward_comm`` call (0.19): read from the installed code, not a version table;
    once per dispatcher class."""
    code = getattr(inspect.unwrap(dispatcher_type.token_combine), "__code__", None)
    return code is not None and "post_forward_comm" in code.co_names


@dataclass(frozen=True)
class TokenDispatch:
    """WRAP of ``MoEAlltoAllTokenDispatcher.token_dispatch``: defer the all-to-all to the experts' step."""

    fall_back: Fallback

    def __call__(self, wrapped, instance, args, kwargs):
        instance.__dict__.pop(PENDING, None)
        instance.__dict__.pop(COMBINED, None)
        shared = getattr(instance, "shared_experts", None)
        if shared is not None:
            shared.__dict__.pop(FC2_DONE, None)  # a mark left by a pipelined call whose megatron skipped it
        reason = why_not(instance)
        if reason is not None:
            self.fall_back(reason)
            return wrapped(*args, **kwargs)
        call = Call(wrapped, args, kwargs)
        tokens, probs = call["permutated_local_input_tokens"], call["permuted_probs"]
        sync = instance._maybe_dtoh_and_synchronize
        instance.tokens_per_expert = sync("before_ep_alltoall", instance.tokens_per_expert)
        setattr(instance, PENDING, (tokens, probs))
        return tokens, probs


def _take_pending(layer: Any, tokens: torch.Tensor, fall_back: Fallback) -> bool:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    dispatcher = getattr(layer, "token_dispatcher", None)
    if not isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
        fall_back(
            f"token dispatcher {type(dispatcher).__name__} is not the alltoall dispatcher "
            "(moe_token_dispatcher_type='alltoall'): nothing to overlap"
        )
        return False
    pending = dispatcher.__dict__.pop(PENDING, None)
    if pending is None:
        return False  # token_dispatch kept megatron's path (and said why)
    if pending[0] is not tokens:
        raise RuntimeError(
            f"{FEATURE_NAME}: the experts' step received other tokens than token_dispatch deferred "
            "(something between MoELayer.dispatch and the experts changed them); switch the feature off"
        )
    return True


@dataclass(frozen=True)
class RoutedExpertsCompute:
    """WRAP of ``MoELayer.routed_experts_compute(hidden_states, probs[, residual])`` (0.15+): returns the
    combined rows, as ``token_combine`` would have."""

    fall_back: Fallback
    recompute: bool = False

    def __call__(self, wrapped, instance, args, kwargs):
        call = Call(wrapped, args, kwargs)
        tokens, probs = call["hidden_states"], call["probs"]
        if not _take_pending(instance, tokens, self.fall_back):
            return wrapped(*args, **kwargs)
        return run_pipeline(instance, tokens, probs, self.recompute), None


@dataclass(frozen=True)
class ExpertsCompute:
    """WRAP of 0.13-0.14's ``MoELayer.experts_compute(hidden_states, probs, residual)``, which
    also computes the shared experts first (when megatron does not overlap them), checkpointed
    under 0.14's ``shared_experts_recompute``: its code, for the same order of work."""

    fall_back: Fallback
    recompute: bool = False

    def __call__(self, wrapped, instance, args, kwargs):
        call = Call(wrapped, args, kwargs)
        tokens, probs = call["hidden_states"], call["probs"]
        if not _take_pending(instance, tokens, self.fall_back):
            return wrapped(*args, **kwargs)
        shared = None
        if instance.use_shared_expert and not instance.shared_expert_overlap:
            shared = _shared_experts(instance, call["residual"])
        return run_pipeline(instance, tokens, probs, self.recompute), shared, None


def _shared_experts(layer: Any, residual: torch.Tensor) -> torch.Tensor:
    if not getattr(layer, "shared_experts_recompute", False):  # 0.14 added the recompute
        return layer.shared_experts(residual)
    import sys

    from megatron.core import parallel_state, tensor_parallel

    if layer.config.fp8:
        te_checkpoint = sys.modules[type(layer).__module__].te_checkpoint
        return te_checkpoint(
            layer.shared_experts,
            False,
            tensor_parallel.random.get_cuda_rng_tracker,
            parallel_state.get_tensor_model_parallel_group(),
            residual,
        )
    return tensor_parallel.checkpoint(layer.shared_experts, False, residual)


@dataclass(frozen=True)
class TokenCombine:
    """WRAP of ``MoEAlltoAllTokenDispatcher.token_combine``: after the pipeline, the rows are back.
    Where megatron's ``token_combine`` also runs the overlapped shared experts' fc2 and
    ``post_forward_comm`` (0.19), those two calls are made here (the fc2 is the pipeline's)."""

    def __call__(self, wrapped, instance, args, kwargs):
        if instance.__dict__.pop(COMBINED, False):
            rows = Call(wrapped, args, kwargs)["hidden_states"]
            shared = getattr(instance, "shared_experts", None)
            if shared is not None and _combine_runs_shared_experts(type(instance)):
                shared.linear_fc2_forward(rows)
                shared.post_forward_comm()
            return rows
        return wrapped(*args, **kwargs)


def shared_fc2_done(wrapped, instance, args, kwargs):
    """WRAP of ``SharedExpertMLP.linear_fc2_forward``: a no-op once the pipeline ran the fc2 (its
    output is already in ``cached_fc2_output``); megatron's call otherwise."""
    if instance.__dict__.pop(FC2_DONE, False):
        return None
    return wrapped(*args, **kwargs)
