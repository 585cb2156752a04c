"""MoE top-k routing as one autograd Function: scores, expert choice, normalisation, scaling.

Megatron's unfused ``topk_routing_with_score_function`` is a chain of a dozen eager ops
(score function, top-k or group-limited top-k, gather, normalisation, scaling, two scatters),
each recorded by autograd with its own saved tensors; TransformerEngine's
``fused_topk_with_score_function`` is the CUDA-only fused form. :func:`topk_routing` computes
the same result in one ``torch.autograd.Function``:

- the forward runs the same ATen ops in the same order as megatron, so probabilities and map
  are bitwise megatron's (fp32, and bf16/fp16 too with the matching ``fp32_intermediates``);
- the backward is written by hand with the same ATen backward kernels autograd would call
  (``_softmax_backward_data``, ``sigmoid_backward``, the division's two terms), applied in the
  same order, so input gradients are bitwise megatron's as well; it touches only the ``k``
  selected entries per token where the math allows (post-softmax, sigmoid), and saves only:

  ===================  ===============================================  ====================
  score function       saved for backward                               megatron's graph
  ===================  ===============================================  ====================
  softmax (post)       indices + k softmax outputs per token            the same, + 2 scatter
  softmax (pre)        indices + the [tokens, experts] softmax output   the same
  sigmoid              indices + k sigmoid outputs + 1 sum per token    + the [tokens, experts]
                                                                         sigmoid output
  ===================  ===============================================  ====================

Expert bias (DeepSeek-V3's aux-loss-free balancing) is added to the scores for the choice only:
the probabilities are the unbiased scores at the chosen experts. Group-limited routing
(``num_groups``/``group_topk``) scores each group by the sum of its top ``topk // group_topk``
scores, keeps ``group_topk`` groups and picks the top ``topk`` experts inside them (megatron's
``group_limited_topk``, op for op).

``fp32_intermediates``: megatron-core up to 0.18 rounds the scores back to the logits' dtype after
the score function (``.type_as(logits)`` at each step); from 0.19 every intermediate stays fp32
and only the final probabilities are cast. In fp32 both are the same computation.
``sorted_topk``: megatron 0.19 asks ``torch.topk`` for unsorted results when autograd is off;
the order of the k values decides the bits of their sum (sigmoid normalisation).

:func:`aux_loss_scores` is the same treatment of ``compute_routing_scores_for_aux_loss`` (the
scores the load-balancing losses read, and their top-k map).

Backends (``kernels.backend.backend_for``):

- ``portable``: the Functions above.
- ``npu``: torch_npu's ``npu_moe_gating_top_k_softmax(x, finished=None, k=1) -> (y, expert_idx,
  row_idx)`` chooses the experts (softmax score function without groups or expert bias; the
  op's documented contract, emulated in ``testing/npu_emulator/moe_gating.py``). The op is
  documented for inference only (no backward), so it runs inside our Function's forward and
  the backward is ours. Everything else (sigmoid, groups, bias) runs the portable Function.
  ``npu_moe_gating_top_k`` (sigmoid + groups + bias) is not used: its documented contract
  supports only 256 experts, ``k_group=4`` and a mandatory bias on A2/A3, and does not state
  the group score megatron uses.
- ``reference``: megatron's eager chain under autograd (the oracle; tests also run it in float64).
"""

from __future__ import annotations

import torch

from mindspeed_like.kernels.backend import backend_for

SCORE_FUNCTIONS = ("softmax", "sigmoid")
_EPS = 1e-20  # megatron's denominator guard of the sigmoid normalisation


def _topk(scores: torch.Tensor, k: int, sorted_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(scores, k=k, dim=1, sorted=sorted_topk)


def _group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's ``group_limited_topk``, op for op (the bits of the chosen values depend on it)."""
    num_tokens, num_experts = scores.shape
    group_scores = scores.view(num_tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups).reshape(num_tokens, -1)
    )
    masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked_scores, k=topk, dim=-1)


def _choose(
    scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None, sorted_topk: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if group_topk:
        return _group_limited_topk(scores, topk, num_groups, group_topk)
    return _topk(scores, topk, sorted_topk)


def _dense(logits: torch.Tensor, indices: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(1, indices, True)
    return routing_probs, routing_map


class _TopKRouting(torch.autograd.Function):
    """Portable backend of :func:`topk_routing` (see the module docstring for what is saved)."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        topk: int,
        use_pre_softmax: bool,
        num_groups: int | None,
        group_topk: int | None,
        scaling_factor: float | None,
        score_function: str,
        expert_bias: torch.Tensor | None,
        sorted_topk: bool,
        fp32_intermediates: bool,
        npu_choice: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = logits.dtype
        keep = (lambda t: t) if fp32_intermediates else (lambda t: t.type_as(logits))
        ctx.score_function, ctx.use_pre_softmax = score_function, use_pre_softmax
        ctx.scaling_factor, ctx.fp32_intermediates, ctx.topk = scaling_factor, fp32_intermediates, topk
        ctx.has_bias, ctx.logits_dtype, ctx.shape = expert_bias is not None, dtype, logits.shape
        if score_function == "softmax":
            if use_pre_softmax:
                full = torch.softmax(logits, dim=-1, dtype=torch.float32)
                scores = keep(full)
                if npu_choice:
                    probs, indices = _npu_choice(logits, topk, scores)
                else:
                    probs, indices = _choose(scores, topk, num_groups, group_topk, sorted_topk)
            else:
                if npu_choice:
                    _, indices = _npu_choice(logits, topk, None)
                    values = logits.gather(1, indices)
                else:
                    values, indices = _choose(logits, topk, num_groups, group_topk, sorted_topk)
                full = torch.softmax(values, dim=-1, dtype=torch.float32)  # k outputs per token
                probs = keep(full)
            ctx.save_for_backward(indices, full)  # fp32: what softmax's backward reads
        else:
            full = torch.sigmoid(logits.float())
            scores = keep(full)
            if expert_bias is not None:
                routing = scores + (expert_bias.float() if fp32_intermediates else expert_bias)
                _, indices = _choose(routing, topk, num_groups, group_topk, sorted_topk)
                selected = keep(torch.gather(scores, dim=1, index=indices))
            else:
                selected, indices = _choose(scores, topk, num_groups, group_topk, sorted_topk)
            sig = full.gather(1, indices)  # the sigmoid outputs sigmoid_backward needs, k per token
            if topk > 1:
                denominator = selected.sum(dim=-1, keepdim=True) + _EPS
                probs = selected / denominator
                ctx.save_for_backward(indices, sig, denominator)
            else:
                probs = selected
                ctx.save_for_backward(indices, sig)
        if scaling_factor:
            probs = probs * scaling_factor
        if fp32_intermediates:
            probs = probs.type_as(logits)
        routing_probs, routing_map = _dense(logits, indices, probs)
        ctx.mark_non_differentiable(routing_map)
        return routing_probs, routing_map

    @staticmethod
    def backward(ctx, grad_probs: torch.Tensor, _grad_map: torch.Tensor | None):
        indices = ctx.saved_tensors[0]
        grad = grad_probs.gather(1, indices)  # backward of the scatter into [tokens, experts]
        if ctx.fp32_intermediates:
            grad = grad.float()  # backward of the final .type_as(logits)
        if ctx.scaling_factor:
            grad = grad * ctx.scaling_factor
        dtype = ctx.logits_dtype
        score_dtype = torch.float32 if ctx.fp32_intermediates else dtype
        if ctx.score_function == "softmax":
            (_, full) = ctx.saved_tensors
            if ctx.use_pre_softmax:
                # topk's backward (a scatter into zeros shaped like the scores), the type_as's,
                # then softmax's own backward on its full output
                grad_scores = grad.new_zeros(ctx.shape, dtype=score_dtype).scatter(1, indices, grad.to(score_dtype))
                grad_logits = torch._softmax_backward_data(grad_scores.float(), full, -1, torch.float32).to(dtype)
                return (grad_logits, *(None,) * 10)
            grad_values = torch._softmax_backward_data(grad.float(), full, -1, torch.float32).to(dtype)
            return (grad.new_zeros(ctx.shape, dtype=dtype).scatter(1, indices, grad_values), *(None,) * 10)
        sig = ctx.saved_tensors[1]
        selected = sig if ctx.fp32_intermediates else sig.to(dtype)
        grad = grad.to(selected.dtype)
        if ctx.topk > 1:
            denominator = ctx.saved_tensors[2]
            # DivBackward0: grad / d for the numerator, -grad * ((s / d) / d) summed for d
            grad_den = (-grad * ((selected / denominator) / denominator)).sum(dim=-1, keepdim=True)
            grad = grad / denominator + grad_den
        if ctx.has_bias:
            grad = grad + 0.0  # gather's backward is a scatter_add into zeros: -0.0 becomes +0.0
        grad_sig = torch.ops.aten.sigmoid_backward(grad.float(), sig)
        grad_logits = grad_sig.new_zeros(ctx.shape).scatter(1, indices, grad_sig).to(dtype)
        return (grad_logits, *(None,) * 10)


def _npu_choice(
    logits: torch.Tensor, topk: int, scores: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Experts chosen by torch_npu's ``npu_moe_gating_top_k_softmax`` (softmax, then top-k).

    Returns the chosen softmax values taken from ``scores`` (our softmax, so the probabilities
    do not depend on the op's internal precision) and int64 indices.
    """
    from mindspeed_like.kernels.backends.npu import torch_npu

    _, expert_idx, _ = torch_npu().npu_moe_gating_top_k_softmax(logits.detach(), None, k=topk)
    indices = expert_idx.long()
    return (None if scores is None else scores.gather(1, indices)), indices


def topk_routing_reference(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: the eager chain under autograd, every intermediate in the logits' dtype
    (run in float64 by the tests)."""
    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            probs, indices = _choose(scores, topk, num_groups, group_topk, True)
        else:
            values, indices = _choose(logits, topk, num_groups, group_topk, True)
            probs = torch.softmax(values, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        if expert_bias is not None:
            _, indices = _choose(scores + expert_bias.to(scores.dtype), topk, num_groups, group_topk, True)
            selected = scores.gather(1, indices)
        else:
            selected, indices = _choose(scores, topk, num_groups, group_topk, True)
        probs = selected / (selected.sum(dim=-1, keepdim=True) + _EPS) if topk > 1 else selected
    if scaling_factor:
        probs = probs * scaling_factor
    return _dense(logits, indices, probs)


def _check(
    logits: torch.Tensor, topk: int, score_function: str, num_groups: int | None, group_topk: int | None
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"topk_routing expects 2D logits [tokens, experts], got shape {tuple(logits.shape)}")
    if score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"topk_routing: score_function {score_function!r} is not one of {SCORE_FUNCTIONS}")
    if not 0 < topk <= logits.shape[1]:
        raise ValueError(f"topk_routing: topk={topk} must be in [1, {logits.shape[1]}] (the number of experts)")
    if group_topk:
        # what megatron's group_limited_topk can compute (its TransformerConfig asserts the first two; torch's
        # topk the third): equal groups, at most num_groups kept, each group scored by its top topk // group_topk
        # experts (rounded down as megatron does: topk need not be a multiple of group_topk, e.g. 8 groups,
        # 3 kept, top-4, as megatron's TestGroupLimitedRouter runs it)
        experts = logits.shape[1]
        if (
            not num_groups
            or experts % num_groups
            or not 0 < group_topk <= num_groups
            or (topk // group_topk > experts // num_groups)
        ):
            raise ValueError(
                f"topk_routing: group-limited routing needs num_groups dividing the {experts} experts, "
                f"0 < group_topk <= num_groups and topk // group_topk <= experts per group; got "
                f"num_groups={num_groups}, group_topk={group_topk}, topk={topk}"
            )


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    *,
    sorted_topk: bool = True,
    fp32_intermediates: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``logits`` [tokens, experts]: ``(routing_probs, routing_map)``, both
    [tokens, experts] (probabilities in the logits' dtype, zero off the map; the map bool),
    exactly megatron's ``topk_routing_with_score_function`` (arguments of the same names)."""
    _check(logits, topk, score_function, num_groups, group_topk)
    backend = backend_for(logits)
    if backend == "reference":
        return topk_routing_reference(
            logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, expert_bias
        )
    npu_choice = backend == "npu" and score_function == "softmax" and not group_topk and expert_bias is None
    return _TopKRouting.apply(
        logits,
        topk,
        use_pre_softmax,
        num_groups,
        group_topk,
        scaling_factor,
        score_function,
        expert_bias,
        sorted_topk,
        fp32_intermediates,
        npu_choice,
    )


class _AuxLossScores(torch.autograd.Function):
    """Portable backend of :func:`aux_loss_scores`: saves the full scores (softmax) or the
    sigmoid output and the per-token sum (sigmoid), what the backward needs."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, topk: int, score_function: str, sigmoid_in_fp32: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.score_function, ctx.dtype = score_function, logits.dtype
        if score_function == "softmax":
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            ctx.save_for_backward(scores)
        else:
            sig = torch.sigmoid(logits.float() if sigmoid_in_fp32 else logits)
            denominator = sig.sum(dim=-1, keepdim=True) + _EPS
            scores = sig / denominator
            ctx.save_for_backward(sig, denominator)
        _, indices = torch.topk(scores, k=topk, dim=1)
        routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(1, indices, True)
        ctx.mark_non_differentiable(routing_map)
        return routing_map, scores

    @staticmethod
    def backward(ctx, _grad_map: torch.Tensor | None, grad: torch.Tensor):
        if ctx.score_function == "softmax":
            (scores,) = ctx.saved_tensors
            return torch._softmax_backward_data(grad, scores, -1, torch.float32).to(ctx.dtype), None, None, None
        sig, denominator = ctx.saved_tensors
        grad = grad.to(sig.dtype)
        grad_den = (-grad * ((sig / denominator) / denominator)).sum(dim=-1, keepdim=True)
        grad_sig = grad / denominator + grad_den
        return torch.ops.aten.sigmoid_backward(grad_sig, sig).to(ctx.dtype), None, None, None


def aux_loss_scores_reference(
    logits: torch.Tensor, topk: int, score_function: str = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle of :func:`aux_loss_scores` (eager, in the logits' dtype)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        sig = torch.sigmoid(logits)
        scores = sig / (sig.sum(dim=-1, keepdim=True) + _EPS)
    _, indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(1, indices, True)
    return routing_map, scores


def aux_loss_scores(
    logits: torch.Tensor, topk: int, score_function: str = "softmax", *, sigmoid_in_fp32: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing_map, scores)`` for the load-balancing losses: megatron's unfused
    ``compute_routing_scores_for_aux_loss`` (without the padding mask, applied by the caller).
    Scores are fp32 for softmax; for sigmoid in fp32 (megatron 0.17-0.19) or, with
    ``sigmoid_in_fp32=False``, in the logits' dtype (megatron up to 0.16)."""
    _check(logits, topk, score_function, None, None)
    if backend_for(logits) == "reference":
        return aux_loss_scores_reference(logits, topk, score_function)
    return _AuxLossScores.apply(logits, topk, score_function, sigmoid_in_fp32)
