"""moe-zero-memory outside the all-to-all pipeline: the routed experts' whole forward recomputed in
backward, one autograd node per experts call.

Where moe-alltoall-overlap's pipeline runs the experts (EP > 1, alltoall dispatcher), it recomputes
them per chunk itself (``pipeline.OverlappedExperts(recompute=True)``). Everywhere else (EP = 1,
the allgather dispatcher, one expert per rank, ...) megatron calls the experts module once per MoE
layer with the permuted rows: ``forward(permuted_local_hidden_states, tokens_per_expert,
permuted_probs)``, the same signature in ``SequentialMLP``, ``GroupedMLP`` and ``TEGroupedMLP``
(0.13-0.19). That call is the patch target: it is the smallest unit that holds every expert
activation (fc1 output, the activation's output, fc2's input, and on grouped experts the stacked
weights the grouped GEMM keeps for its backward) and nothing of the router or the permutation.

:class:`RecomputedExperts` runs the call without a graph in forward and saves only its inputs
(the permuted rows and their probs, through ``save_for_backward`` so saved-tensor hooks and
``SavedBytesMeter`` see them); backward runs the same call again with grad on and differentiates it.
Same rows, same ops, same order: results are bitwise megatron's. The experts' parameters are inputs
of the node, so each receives one gradient per backward (megatron's DDP hooks fire once, as without
the feature).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.errors import FeatureUnsupported
from mindspeed_like.toolkit.fallback import Fallback
from mindspeed_like.toolkit.recompute import inside_whole_recompute, whole_recompute


class MoeZeroMemoryUnsupported(FeatureUnsupported):
    """An experts call the whole-experts recompute cannot take (raised under --strict)."""


def why_not(experts: torch.nn.Module) -> str | None:
    """The reason this experts module keeps megatron's activations, or None."""
    config = experts.config
    if getattr(config, "add_bias_linear", False):
        return "expert biases (add_bias_linear): an expert may hand its output bias to the caller, outside the node"
    if getattr(experts, "offload_moe_act", False):
        return "offload_moe_act: megatron already moves the experts' activation off the device"
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return "FP8/FP4 experts: a recompute would advance their amax history a second time"
    if getattr(config, "delay_wgrad_compute", False):
        return "delay_wgrad_compute: megatron schedules the experts' weight gradients itself"
    if getattr(config, "cuda_graph_impl", "none") not in ("none", None) or getattr(config, "enable_cuda_graph", False):
        return "CUDA graphs capture the experts as they are"
    return None


class RecomputedExperts(torch.autograd.Function):
    """``run(rows, probs)`` as one node: forward without a graph, keeping only ``rows`` and
    ``probs``; backward reruns it with grad on and returns the gradients of rows, probs and the
    experts' parameters."""

    @staticmethod
    def forward(ctx, run: Callable, rows: torch.Tensor, probs: torch.Tensor, *params: torch.Tensor):
        with torch.no_grad():
            out = run(rows, probs)
        ctx.save_for_backward(rows.detach(), probs.detach())
        ctx.run, ctx.params = run, params
        ctx.grad_flags = (rows.requires_grad, probs.requires_grad)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        rows, probs = ctx.saved_tensors
        params, run = ctx.params, ctx.run
        ctx.run = ctx.params = None
        rows = rows.detach().requires_grad_(ctx.grad_flags[0])
        probs = probs.detach().requires_grad_(ctx.grad_flags[1])
        with torch.enable_grad(), whole_recompute():
            out = run(rows, probs)
        inputs = [t for t in (rows, probs, *params) if t.requires_grad]
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True) if out.requires_grad else ()
        by_input = dict(zip(map(id, inputs), grads))
        return (None, by_input.get(id(rows)), by_input.get(id(probs)), *(by_input.get(id(p)) for p in params))


@dataclass(frozen=True)
class ExpertsForward:
    """WRAP of the experts modules' ``forward(permuted_local_hidden_states, tokens_per_expert,
    permuted_probs)`` (``SequentialMLP``, ``GroupedMLP``, ``TEGroupedMLP``): the call as one
    :class:`RecomputedExperts` node when a graph is being built."""

    fall_back: Fallback

    def __call__(self, wrapped, instance, args, kwargs):
        if instance is None or not torch.is_grad_enabled() or inside_whole_recompute():
            return wrapped(*args, **kwargs)
        call = Call(wrapped, args, kwargs)
        rows, probs = call["permuted_local_hidden_states"], call["permuted_probs"]
        params = [p for p in instance.parameters() if p.requires_grad]
        if not (rows.requires_grad or probs.requires_grad or params):
            return wrapped(*args, **kwargs)
        reason = why_not(instance)
        if reason is not None:
            self.fall_back(reason)
            return wrapped(*args, **kwargs)

        def run(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            with whole_recompute():
                out, _bias = call(permuted_local_hidden_states=x, permuted_probs=p)  # None: see why_not
            return out

        return RecomputedExperts.apply(run, rows, probs, *params), None
