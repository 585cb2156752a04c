"""grouped-gemm on megatron-core 0.17+: the local spec's experts as one grouped GEMM per linear.

megatron-core 0.17 deleted the legacy ``GroupedMLP`` and ``grouped_gemm_util``: with
``moe_grouped_gemm=True`` the local spec (``LocalSpecProvider.grouped_mlp_modules``) now builds
``SequentialMLP``, a loop over the local experts, each an ``MLP`` with its own
``ColumnParallelLinear`` fc1 and ``RowParallelLinear`` fc2 (only TransformerEngine's
``TEGroupedMLP`` groups the GEMMs there). So ``moe_grouped_gemm=True`` asks for grouped GEMMs and,
without TE, silently gets the loop. This is where the feature applies on 0.17+.

Target, and why it is the right symbol:

- ``megatron.core.transformer.moe.experts.SequentialMLP.forward`` (WRAP): the loop lives in
  this method (split tokens per expert, call each expert, ``cat``). When its config has
  ``moe_grouped_gemm=True`` the wrapper makes ONE call of the first expert's ``MLP.forward`` for
  all tokens, with that expert's two linears shadowed (on the instance, for the call) by grouped
  linears: fc1 is ``gmm_experts(x, fc1 weights, tokens_per_expert)``, fc2 the same with the fc2
  weights. Everything between them is megatron's own activation code of the installed version
  (per-token probs included), and any wrapper stacked on ``MLP.forward`` (fused-swiglu's kernel,
  recompute-activation-function's recompute) runs exactly as for one expert: only the two matmuls
  change. With ``moe_grouped_gemm=False`` megatron's loop runs untouched.

The expert linears of ``SequentialMLP`` do no communication of their own (megatron's
``explicit_expert_comm``: the dispatcher moves tokens; at TP=1 without EP the collectives are
identities), so each is one matmul with the expert's local weight shard, and the grouped GEMM is
the same math (parity tested against megatron's loop). The GEMM takes the experts' own weights
(``GroupedGemmOps.gmm_experts``): autograd keeps them as they are, no stacked ``[E, out, in]``
copy (one is made for one kernel call at a time where the kernel takes one tensor), so
megatron's per-expert parameters (and so its checkpoints and DDP buckets) stay unchanged at no
memory cost.

Handed back to megatron's loop, logged once (an error under ``--strict``): fp8/fp4 (per-expert
padding and quantization), biases on the expert linears, ``moe_apply_probs_on_input``, expert
linears other than megatron's Column/RowParallelLinear, and ``--gemm-gradient-accumulation-fusion``
(the per-expert weights have no one ``main_grad`` to accumulate into: the gradient is computed
normally and that is logged). One local expert runs megatron's path (there is nothing to group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.fallback import Fallback


class GroupedLinear(torch.nn.Module):
    """An expert linear's stand-in for one grouped call: ``x -> (gmm_experts(x, weights, counts), None)``.

    An ``nn.Module`` because megatron-core 0.17+ calls its linears through
    ``typed_torch.apply_module``, which refuses anything else."""

    def __init__(self, gmm_experts, weights: list[torch.Tensor], counts: torch.Tensor) -> None:
        super().__init__()
        self._gmm_experts = gmm_experts
        self._weights = weights
        self._counts = counts

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape  # each weight [out, in]: megatron's layout, no stacked copy kept
        output = self._gmm_experts(hidden_states.reshape(-1, shape[-1]), self._weights, self._counts, trans_b=True)
        return output.reshape(*shape[:-1], output.shape[-1]), None


def _plain_linears(expert) -> str | None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    fc1, fc2 = expert.linear_fc1, expert.linear_fc2
    if type(fc1) is not ColumnParallelLinear or type(fc2) is not RowParallelLinear:
        return f"expert linears are {type(fc1).__name__}/{type(fc2).__name__}, not megatron's Column/RowParallelLinear"
    if getattr(fc1, "bias", None) is not None or getattr(fc2, "bias", None) is not None:
        return "expert linears with biases"
    for linear in (fc1, fc2):
        group = linear.tp_group
        if not getattr(linear, "explicit_expert_comm", False) and group is not None and group.size() > 1:
            return "expert linears that communicate themselves"
    return None


def unsupported(module) -> str | None:
    config = module.config
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return "fp8/fp4: megatron pads and quantizes per expert"
    if getattr(config, "moe_apply_probs_on_input", False):
        return "moe_apply_probs_on_input"
    return _plain_linears(module.local_experts[0])


@dataclass(frozen=True)
class SequentialExpertsForward:
    """Wrapper of ``SequentialMLP.forward`` (megatron-core 0.17+): see the module docstring.

    gmm_ops: ``GroupedGemmOps`` (its ``gmm_experts``: backend choice, NPU group limit).
    accumulate_main_grad: ``--gemm-gradient-accumulation-fusion`` (not available here: logged).
    """

    gmm_ops: object
    accumulate_main_grad: bool
    fall_back: Fallback

    def __call__(self, wrapped, instance, args, kwargs):
        grouped = instance is not None and getattr(instance.config, "moe_grouped_gemm", False)
        if not grouped or instance.num_local_experts < 2:
            return wrapped(*args, **kwargs)
        reason = unsupported(instance)
        if reason is not None:
            self.fall_back(reason)
            return wrapped(*args, **kwargs)
        if self.accumulate_main_grad and torch.is_grad_enabled():
            self.fall_back(
                "--gemm-gradient-accumulation-fusion: SequentialMLP keeps one weight per expert, so the expert "
                "weight gradients are computed normally (megatron's DDP still accumulates them into main_grad)"
            )
        call = Call(wrapped, args, kwargs)
        hidden = call["permuted_local_hidden_states"]
        counts = call["tokens_per_expert"]
        probs = call["permuted_probs"]
        counts = torch.as_tensor(counts).to(device="cpu", dtype=torch.int64)
        experts = instance.local_experts
        lead = experts[0]
        shadow = lead.__dict__  # found before nn.Module.__getattr__ looks in _modules
        saved = {name: shadow[name] for name in ("linear_fc1", "linear_fc2") if name in shadow}
        shadow["linear_fc1"] = GroupedLinear(self.gmm_ops.gmm_experts, [e.linear_fc1.weight for e in experts], counts)
        shadow["linear_fc2"] = GroupedLinear(self.gmm_ops.gmm_experts, [e.linear_fc2.weight for e in experts], counts)
        try:
            output, _ = lead(hidden, probs)
        finally:
            for name in ("linear_fc1", "linear_fc2"):
                if name in saved:
                    shadow[name] = saved[name]
                else:
                    del shadow[name]
        return output, None
