"""fused-swiglu's mechanism: megatron's gated-silu MLP activation runs through
``mindspeed_like.kernels.swiglu`` (torch_npu's ``npu_swiglu`` on NPU, a portable fused
autograd Function elsewhere) that saves only the activation's input for backward.

Only swiglu configs are affected (``gated_linear_unit`` with ``F.silu``): gelu/geglu, clamped
GLUs (``activation_func_clamp_value``), ``glu_linear_offset`` != 0, TransformerEngine
activations and fp8 input storage keep megatron's own code.

Targets, and why each is the right symbol:

- ``megatron.core.fusions.fused_bias_swiglu.bias_swiglu_impl`` (WRAP): the one entry point of
  megatron's bias+swiglu fusion; ``transformer.mlp`` and ``transformer.moe.shared_experts``
  import it by name, and the engine re-points those aliases. Calls with ``fp8_input_store`` or
  ``cpu_offload_input`` fall through to megatron's (we do not store fp8 or tag offloading).
- ``megatron.core.fusions.fused_bias_swiglu.weighted_bias_swiglu_impl`` (WRAP): the
  per-token-weighted variant used by ``MLP.forward`` for MoE experts (probabilities as
  ``per_token_scale``) and by ``moe.experts.TEGroupedMLP``; aliased in both modules.
- ``megatron.core.transformer.mlp.MLP.forward`` (WRAP): with ``bias_activation_fusion`` off,
  megatron computes the GLU inline in a closure built inside ``forward`` itself (nothing
  stored on the module can be swapped), so the call is run with a *view* of the config
  that has ``bias_activation_fusion=True``: megatron's own fused branch then executes,
  calling the two functions above, and fc1, fc2, bias and per-token-scale handling stay
  megatron's code. Covers dense MLPs, ``SequentialMLP``'s experts (they are MLPs) and
  ``SharedExpertMLP`` (its ``forward`` calls ``MLP.forward``). The inline path's math is
  the same (``silu(a) * b`` after adding the fc1 bias; per-token scale multiplied in the
  promoted dtype and cast back), so numerics match in fp32. Not taken when megatron's fused
  branch would behave differently: a per-token scale together with an fc1 bias (megatron's
  weighted fusion rejects a bias), clamp or linear offset set.

- ``megatron.core.transformer.moe.experts.TEGroupedMLP.forward`` (WRAP): the TE spec's grouped
  experts (built on the te-backend without TransformerEngine) also compute the GLU inline in a
  closure (``bias_act_func``) unless ``bias_activation_fusion``; redirected the same way to
  ``weighted_bias_swiglu_impl`` (probabilities multiplied in the promoted dtype and cast back, as
  inline). Left alone while megatron's moe_act recompute is on for the call (its recompute runs
  after this call returned and would read the original config: forward and recompute must
  compute the same activation).

Not covered: ``GroupedMLP`` (megatron-core < 0.17) builds its own ``glu`` closure;
``SharedExpertMLP``'s stream-overlap branch (``moe_shared_expert_overlap``, run on a host too)
computes its GLU inline in ``linear_fc1_forward_and_act``. Their fused branches go through the
wrapped functions.
"""

from __future__ import annotations

import torch.nn.functional as F

from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.overrides import config_fields


def bias_swiglu_impl(wrapped, instance, args, kwargs):
    """Wrapper of ``bias_swiglu_impl``: our fused kernel unless fp8 storage / offloading is asked."""
    from mindspeed_like.kernels.swiglu import swiglu

    call = Call(wrapped, args, kwargs)
    input = call["input"]
    if call.get("fp8_input_store") or call.get("cpu_offload_input") or input.dim() not in (2, 3):
        return wrapped(*args, **kwargs)
    return swiglu(input, call["bias"])


def weighted_bias_swiglu_impl(wrapped, instance, args, kwargs):
    """Wrapper of ``weighted_bias_swiglu_impl`` (per-token-scaled, MoE experts)."""
    from mindspeed_like.kernels.swiglu import weighted_swiglu

    call = Call(wrapped, args, kwargs)
    input = call["input"]
    if call["bias"] is not None or call.get("fp8_input_store") or input.dim() not in (2, 3):
        return wrapped(*args, **kwargs)  # megatron's own checks and errors
    return weighted_swiglu(input, call["weights"])


def is_swiglu_inline(mlp) -> bool:
    """True when ``mlp`` would compute a plain swiglu inline (the case we redirect)."""
    config = mlp.config
    return (
        bool(config.gated_linear_unit)
        and config.activation_func is F.silu
        and getattr(mlp, "activation_func", None) is F.silu
        and not config.bias_activation_fusion
        and not getattr(config, "use_te_activation_func", False)
        and getattr(config, "activation_func_clamp_value", None) is None
        and getattr(config, "glu_linear_offset", 0.0) == 0.0
    )


def mlp_forward(wrapped, instance, args, kwargs):
    """Wrapper of ``MLP.forward``: the inline GLU is run through megatron's fused branch."""
    if instance is None or not is_swiglu_inline(instance):
        return wrapped(*args, **kwargs)
    if (
        Call(wrapped, args, kwargs).get("per_token_scale") is not None
        and getattr(instance.linear_fc1, "bias", None) is not None
    ):
        return wrapped(*args, **kwargs)
    with config_fields(instance, bias_activation_fusion=True):
        return wrapped(*args, **kwargs)


def grouped_experts_forward(wrapped, instance, args, kwargs):
    """Wrapper of ``TEGroupedMLP.forward``: its inline GLU is run through megatron's fused branch."""
    if instance is None or not is_swiglu_inline(instance) or instance.activation_recompute:
        return wrapped(*args, **kwargs)
    if instance.config.add_bias_linear or getattr(instance.config, "moe_apply_probs_on_input", False):
        return wrapped(*args, **kwargs)  # megatron's weighted fusion takes no bias; probs already applied
    with config_fields(instance, bias_activation_fusion=True):
        return wrapped(*args, **kwargs)
