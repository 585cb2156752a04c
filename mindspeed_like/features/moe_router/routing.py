"""moe-router's mechanism: megatron's MoE top-k routing and aux-loss scores run through
``mindspeed_like.kernels.moe_router`` (one autograd Function each, bitwise megatron's unfused path).

Targets, and why each is the right symbol:

- ``megatron.core.transformer.moe.moe_utils.topk_routing_with_score_function`` (WRAP, 0.14+):
  the one function ``TopKRouter.routing`` calls for every score function and routing type but
  sinkhorn (``router.py`` imports it by name; the engine re-points that alias). Its ``fused=``
  argument is megatron's ``moe_router_fusion``: with TransformerEngine absent megatron reaches
  ``if not HAVE_TE or fused_topk_with_score_function is None: raise`` (the TE name is not even
  bound in ``moe_utils`` without TE, and ``HAVE_TE`` is shared by the permute paths), so binding
  a function under TE's name cannot make ``fused=True`` work; the wrapper serves the call
  instead. Calls we do not compute go to megatron with ``fused=False`` where TE is missing (the
  same math): router replay, ``precomputed_indices`` / ``dense_output`` (0.19's quantile
  balancing and inference router), score functions other than softmax/sigmoid (0.19's
  ``sqrtsoftplus``).
- ``...moe_utils.compute_routing_scores_for_aux_loss`` (WRAP, 0.14+): the scores and map every
  load-balancing loss (aux_loss, seq_aux_loss, global_aux_loss) reads; megatron routes it
  through ``fused=`` too (TE's ``fused_compute_score_for_moe_aux_loss``).
- ``...moe_utils.switch_load_balancing_loss_func`` (WRAP, 0.14+): only for ``fused=True``
  without TE's ``fused_moe_aux_loss``: megatron's own unfused loss (the same formula) instead of
  its ValueError. Not computed by our kernel (two reductions; nothing to fuse on CPU).
- ``...moe_utils.topk_softmax_with_capacity`` (WRAP, 0.13): the 0.13 form of the routing
  function, with the capacity/drop step inside; the top-k part is our kernel, the capacity step
  is megatron 0.13's code repeated on our output (it is inside the function we replace).
- ``...moe.router.TopKRouter.compute_routing_scores_for_aux_loss`` (WRAP, 0.13): the 0.13 form
  of the aux-loss scores (a method returning ``(scores, map)``).

Megatron changed the rounding of the unfused path between releases (0.14-0.17 round the scores
to the logits' dtype after each step, 0.18 and 0.19 keep fp32 until the end and sort top-k only
when autograd is on; the aux-loss sigmoid is in the logits' dtype up to 0.16 and in fp32 from 0.17,
spelled ``logits.to(torch.float32)`` in 0.17.1 and ``logits.float()`` in 0.18.2 / 0.19.2), so the
wrapper reads the layout from the installed function's source (:func:`routing_layout`) rather than
from a version table.
"""

from __future__ import annotations

import ast
import functools
import inspect
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.fallback import Fallback


class RoutingLayout(NamedTuple):
    fp32_intermediates: bool
    unsorted_without_grad: bool
    aux_sigmoid_in_fp32: bool


@functools.lru_cache(maxsize=8)
def routing_layout(function) -> RoutingLayout:
    """How the installed megatron rounds its unfused routing (what our kernel must reproduce).

    Read from the source of megatron's own functions: ``probs = probs.type_as(logits)`` once at the
    end (0.18, 0.19) vs ``.type_as(logits)`` after the score function (0.13-0.17); ``sorted=
    torch.is_grad_enabled()`` (0.18, 0.19); the aux-loss sigmoid of the logits made fp32 first
    (:func:`_sigmoid_of_fp32_logits`: 0.17-0.19). Without readable source: the newest layout."""
    try:
        source = inspect.getsource(inspect.unwrap(function))
        aux_source = inspect.getsource(inspect.getmodule(inspect.unwrap(function)))
    except (OSError, TypeError):
        return RoutingLayout(True, True, True)
    return RoutingLayout(
        fp32_intermediates="probs = probs.type_as(logits)" in source,
        unsorted_without_grad="sorted=torch.is_grad_enabled()" in source,
        aux_sigmoid_in_fp32=_sigmoid_of_fp32_logits(aux_source, "compute_routing_scores_for_aux_loss"),
    )


def _is_fp32_cast(node: ast.AST) -> bool:
    """``x.float()``, ``x.to(torch.float32)``, ``x.to(dtype=torch.float32)`` or ``x.type(torch.float32)``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    if node.func.attr == "float":
        return not node.args and not node.keywords
    if node.func.attr not in ("to", "type"):
        return False
    dtypes = [*node.args[:1], *(k.value for k in node.keywords if k.arg == "dtype")]
    return any(isinstance(d, ast.Attribute) and d.attr == "float32" for d in dtypes)


def _sigmoid_of_fp32_logits(module_source: str, function: str) -> bool:
    """Whether ``function`` in megatron's module takes ``torch.sigmoid`` of its logits cast to fp32 first
    (0.17.1: ``torch.sigmoid(logits.to(torch.float32))``, 0.18.2 and 0.19.2: ``torch.sigmoid(logits.float())``)
    rather than in the logits' dtype (``torch.sigmoid(logits)``, 0.14-0.16). Read with ``ast``, so the spelling
    of the cast does not matter; a module without the function: the newest layout (fp32)."""
    tree = ast.parse(module_source)
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function), None)
    if node is None:
        return True
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "sigmoid"
        and n.args
        and _is_fp32_cast(n.args[0])
        for n in ast.walk(node)
    )


def _moe_utils():
    from megatron.core.transformer.moe import moe_utils

    return moe_utils


def te_has(name: str) -> bool:
    """Whether megatron's ``moe_utils`` got TransformerEngine's ``name`` (real TE >= 2.7)."""
    moe_utils = _moe_utils()
    return bool(getattr(moe_utils, "HAVE_TE", False)) and getattr(moe_utils, name, None) is not None


def _unsupported(call: Call) -> str | None:
    from mindspeed_like.kernels.moe_router import SCORE_FUNCTIONS

    if call.get("router_replay") is not None:
        return "router replay (megatron's recorded routing)"
    if call.get("precomputed_indices") is not None:
        return "precomputed_indices (quantile balancing)"
    if call.get("dense_output"):
        return "dense_output (the inference router)"
    if call["score_function"] not in SCORE_FUNCTIONS:
        return f"score_function={call['score_function']!r}"
    return None


@dataclass(frozen=True)
class TopKRouting:
    """Wrapper of ``topk_routing_with_score_function`` (megatron-core 0.14+). ``defer_to_te``:
    switched on only by ``moe_router_fusion``, so an installed TE's fused router keeps its calls."""

    fallback: Fallback
    defer_to_te: bool = False

    def __call__(self, wrapped, instance, args, kwargs):
        from mindspeed_like.kernels.moe_router import topk_routing

        call = Call(wrapped, args, kwargs)
        if self.defer_to_te and call["fused"] and te_has("fused_topk_with_score_function"):
            return wrapped(*args, **kwargs)
        reason = _unsupported(call)
        if reason is not None:
            self.fallback(reason)
            if call["fused"] and not te_has("fused_topk_with_score_function"):
                return call(fused=False)  # TE's fused function is missing: megatron's unfused, same math
            return wrapped(*args, **kwargs)
        layout = routing_layout(wrapped)
        return topk_routing(
            call["logits"],
            call["topk"],
            use_pre_softmax=call["use_pre_softmax"],
            num_groups=call["num_groups"],
            group_topk=call["group_topk"],
            scaling_factor=call["scaling_factor"],
            score_function=call["score_function"],
            expert_bias=call["expert_bias"],
            sorted_topk=torch.is_grad_enabled() if layout.unsorted_without_grad else True,
            fp32_intermediates=layout.fp32_intermediates,
        )


def _mask_padding(routing_map: torch.Tensor, scores: torch.Tensor, padding_mask: torch.Tensor | None):
    """megatron's padding step of ``compute_routing_scores_for_aux_loss`` (True = padding)."""
    if padding_mask is None:
        return routing_map, scores
    valid_mask = (~padding_mask).unsqueeze(-1)
    return routing_map * valid_mask, scores * valid_mask


@dataclass(frozen=True)
class AuxLossScores:
    """Wrapper of ``compute_routing_scores_for_aux_loss`` (megatron-core 0.14+)."""

    fallback: Fallback
    defer_to_te: bool = False

    def __call__(self, wrapped, instance, args, kwargs):
        from mindspeed_like.kernels.moe_router import SCORE_FUNCTIONS, aux_loss_scores

        call = Call(wrapped, args, kwargs)
        if self.defer_to_te and call["fused"] and te_has("fused_compute_score_for_moe_aux_loss"):
            return wrapped(*args, **kwargs)
        if call["score_function"] not in SCORE_FUNCTIONS:
            self.fallback(f"aux-loss scores with score_function={call['score_function']!r}")
            if call["fused"] and not te_has("fused_compute_score_for_moe_aux_loss"):
                return call(fused=False)
            return wrapped(*args, **kwargs)
        layout = routing_layout(_moe_utils().topk_routing_with_score_function)
        routing_map, scores = aux_loss_scores(
            call["logits"], call["topk"], call["score_function"], sigmoid_in_fp32=layout.aux_sigmoid_in_fp32
        )
        return _mask_padding(routing_map, scores, call.get("padding_mask"))


def switch_load_balancing_loss(wrapped, instance, args, kwargs):
    """Wrapper of ``switch_load_balancing_loss_func``: ``fused=True`` without TE's
    ``fused_moe_aux_loss`` computes megatron's unfused loss instead of raising."""
    call = Call(wrapped, args, kwargs)
    if call["fused"] and not te_has("fused_moe_aux_loss"):
        return call(fused=False)
    return wrapped(*args, **kwargs)


def topk_softmax_with_capacity(wrapped, instance, args, kwargs):
    """Wrapper of megatron-core 0.13's ``topk_softmax_with_capacity``: the top-k by our kernel,
    then 0.13's capacity step (repeated from megatron: it lives inside this function)."""
    from mindspeed_like.kernels.moe_router import SCORE_FUNCTIONS, topk_routing

    call = Call(wrapped, args, kwargs)
    if call["score_function"] not in SCORE_FUNCTIONS:
        return wrapped(*args, **kwargs)
    logits, topk = call["logits"], call["topk"]
    topk_masked_gates, topk_map = topk_routing(
        logits,
        topk,
        use_pre_softmax=call["use_pre_softmax"],
        num_groups=call["num_groups"],
        group_topk=call["group_topk"],
        scaling_factor=call["scaling_factor"],
        score_function=call["score_function"],
        expert_bias=call["expert_bias"],
        fp32_intermediates=False,
    )
    tokens_per_expert = topk_map.sum(dim=0)
    capacity_factor = call["capacity_factor"]
    if capacity_factor is None:
        return topk_masked_gates, topk_map, tokens_per_expert
    from megatron.core.transformer.moe.moe_utils import get_capacity

    num_tokens, num_experts = logits.shape
    expert_capacity = get_capacity(
        num_tokens=num_tokens * topk, num_experts=num_experts, capacity_factor=capacity_factor
    )
    drop_policy = call["drop_policy"]
    if drop_policy == "probs":
        _, capacity_indices = torch.topk(topk_masked_gates, k=expert_capacity, dim=0, sorted=False)
    elif drop_policy == "position":
        _, capacity_indices = torch.topk(topk_map.int(), k=expert_capacity, dim=0, sorted=False)
    else:
        raise ValueError(f"Invalid drop_policy: {drop_policy}")
    capacity_mask = torch.zeros_like(logits).scatter(0, capacity_indices, 1).bool()
    final_map = capacity_mask if call["pad_to_capacity"] else torch.logical_and(topk_map, capacity_mask)
    return topk_masked_gates * final_map, final_map, tokens_per_expert


def router_aux_loss_scores(wrapped, instance, args, kwargs):
    """Wrapper of megatron-core 0.13's ``TopKRouter.compute_routing_scores_for_aux_loss``
    (returns ``(scores, map)``; the sigmoid in the logits' dtype)."""
    from mindspeed_like.kernels.moe_router import SCORE_FUNCTIONS, aux_loss_scores

    if instance is None or instance.score_function not in SCORE_FUNCTIONS:
        return wrapped(*args, **kwargs)
    logits = Call(wrapped, args, kwargs)["logits"]
    routing_map, scores = aux_loss_scores(logits, instance.topk, instance.score_function, sigmoid_in_fp32=False)
    return scores, routing_map
