"""recompute-activation-function's mechanism: the MLP activation
output (tokens x ffn, held by fc2 for its weight gradient) is computed without autograd
history, consumed by fc2, its storage freed, and recomputed from fc1's output just before
fc2's backward needs it (a hook on fc2's output), with the RNG states of the forward.

The mechanism is megatron-core's own ``tensor_parallel.CheckpointWithoutOutput`` (0.13+,
used upstream for ``recompute_modules`` ``moe_act``/``layernorm``); its no-TransformerEngine
default-argument bug (``fp8=False`` taken as "fp8 on") is corrected by the always-on fix this
feature requires (``fixes/checkpoint_fp8_default.py``). On 0.13-0.15 and 0.17+ a subclass is
used instead (``checkpoint.py``): on 0.13-0.15, under any saved-tensor hooks, the recompute's
input gradients land on tensor objects that backward never reads, and fc1 silently gets no
gradient (fixed upstream in 0.16); 0.17 made the recompute share the recomputed storage through a
C++ extension compiled at the first backward (g++ at training time, and an activation that
returns a view of its input then hands fc2 the wrong tensor).

Targets, and why each is the right symbol:

- ``megatron.core.transformer.mlp.MLP.forward`` (WRAP): the dense MLP, ``SequentialMLP``'s
  experts (they are ``MLP`` instances called with ``per_token_scale``) and
  ``SharedExpertMLP`` (calls ``MLP.forward``). The activation is inline code in ``forward``
  (gelu, swiglu/geglu with or without ``bias_activation_fusion``, bias add, per-token scale,
  clamp/offset), so nothing on the module can be swapped. The wrapper runs fc1 and fc2
  itself and, as the checkpointed function, calls megatron's own ``forward`` with the two
  linears shadowed on the instance by pass-throughs: fc1 returns the given fc1 output and
  bias, fc2 returns its input. What runs between them is exactly megatron's activation code
  of the installed version (and any wrapper stacked on ``MLP.forward``, e.g. fused-swiglu,
  whose fused kernel then runs inside the recompute). The config object seen at forward is
  put back for the recompute, so a wrapper that swaps ``instance.config`` recomputes the same
  math whatever the wrap order.
- ``megatron.core.transformer.moe.experts.GroupedMLP.forward`` (WRAP, megatron-core < 0.17:
  deleted in 0.17, where ``moe_grouped_gemm`` builds SequentialMLP, covered through
  ``MLP.forward``, also when grouped-gemm runs its experts as grouped GEMMs): megatron already
  recomputes the grouped experts' activation when ``recompute_modules`` has ``moe_act``
  (``self.activation_recompute``, read in ``forward``); the wrapper switches that attribute on
  for the call, so megatron's code does the work. Already on -> untouched (no double recompute).
- ``megatron.core.transformer.transformer_layer.TransformerLayer.__init__`` (WRAP): the
  ``layer_number`` argument is the layer's 1-based number within its model chunk (the
  block passes ``i + 1``; the global number adds the pipeline offset). It is recorded on the
  layer's MLPs/GroupedMLPs for ``--recompute-activation-function-num-layers N``: only the
  first N layers of each pipeline stage (each model chunk with virtual pipelining).

Not recomputed (by design, silently): calls without autograd (``no_grad``, the forward of
megatron's full/selective ``mlp`` recompute) and calls made *inside* a backward pass (the
re-forward of megatron's recompute: its activations live only until that layer's backward,
so a second recompute would cost time and save nothing). Fallbacks (logged once, an error
under ``strict``): fp8/fp4 (TransformerEngine keeps its own quantized copy of fc2's input),
megatron's CPU activation offloading, a per-token scale together with an fc2 bias (megatron
adds that bias in place, differently by version), and a layer selection asked for an MLP
whose layer number is unknown (built outside a TransformerLayer or before the feature was
switched on). ``TEGroupedMLP`` (TE specs, built on the te-backend without TransformerEngine): like
GroupedMLP before 0.17; from 0.17 a fallback (``UncoveredGroupedExperts``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mindspeed_like.features.recompute_activation.checkpoint import (
    hook_safe_checkpoint_class,
    megatron_checkpoint_class,
    saved_tensor_hooks_active,
)
from mindspeed_like.features.recompute_activation.layers import STAGE_LAYER_ATTR
from mindspeed_like.toolkit.binding import Call
from mindspeed_like.toolkit.errors import FeatureUnsupported
from mindspeed_like.toolkit.fallback import Fallback
from mindspeed_like.toolkit.recompute import inside_whole_recompute


class RecomputeActivationUnsupported(FeatureUnsupported):
    """``strict`` is on and an MLP call cannot recompute its activation."""


@dataclass(frozen=True)
class Recompute:
    """What the flags ask for.

    num_layers: recompute only in the first N layers of each pipeline stage (None: all).
    hook_safe: use the hook-safe CheckpointWithoutOutput (megatron-core < 0.16).
    """

    num_layers: int | None
    hook_safe: bool
    fall_back: Fallback

    def checkpoint(self):
        """A new CheckpointWithoutOutput of the right class for the installed megatron-core."""
        return (hook_safe_checkpoint_class() if self.hook_safe else megatron_checkpoint_class())()

    def layer_selected(self, module) -> bool:
        if self.num_layers is None:
            return True
        layer = getattr(module, STAGE_LAYER_ATTR, None)
        if layer is None:
            self.fall_back(
                "--recompute-activation-function-num-layers is set but this MLP's layer number is unknown "
                "(built outside a TransformerLayer or before the feature was switched on)"
            )
            return False
        return layer <= self.num_layers

    def wanted(self, module) -> bool:
        """Grad mode on, not inside a backward pass (a recompute), layer selected."""
        return torch.is_grad_enabled() and not in_backward() and self.layer_selected(module)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (a recompute)."""
    return torch._C._current_graph_task_id() != -1


def _unsupported(config) -> str | None:
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return "fp8/fp4: TransformerEngine keeps its own quantized copy of fc2's input"
    if getattr(config, "cpu_offloading", False) and getattr(config, "cpu_offloading_activations", False):
        return "megatron's CPU activation offloading is on"
    return None


class _PassThrough(torch.nn.Module):
    """A linear's stand-in while megatron's activation code runs: fc1 hands back the given fc1
    output and bias, fc2 records and returns its input. An ``nn.Module`` because megatron-core
    0.17+ calls the linears through ``typed_torch.apply_module``, which refuses anything else."""

    def __init__(self, result=None, fed: list | None = None) -> None:
        super().__init__()
        self._result = result
        self._fed = fed

    def forward(self, hidden_states):
        if self._fed is None:
            return self._result
        self._fed.append(hidden_states)
        return hidden_states, None


_LINEARS = ("linear_fc1", "linear_fc2")


def _megatron_activation(wrapped, instance, config):
    """``fn(fc1_output, fc1_bias, per_token_scale) -> activation output`` running megatron's
    own ``MLP.forward`` between its two linears (shadowed by pass-throughs on the instance;
    whatever stood in the instance's ``__dict__`` before, e.g. grouped-gemm's grouped linears on
    0.17+, is put back afterwards)."""

    def activation(fc1_output, fc1_bias, per_token_scale):
        fed: list[torch.Tensor] = []
        shadow = instance.__dict__  # found before nn.Module.__getattr__ looks in _modules
        saved = {name: shadow[name] for name in _LINEARS if name in shadow}
        saved_config = instance.config
        shadow["linear_fc1"] = _PassThrough(result=(fc1_output, fc1_bias))
        shadow["linear_fc2"] = _PassThrough(fed=fed)
        instance.config = config
        try:
            output, _ = wrapped(fc1_output, per_token_scale=per_token_scale)
        finally:
            for name in _LINEARS:
                if name in saved:
                    shadow[name] = saved[name]
                else:
                    del shadow[name]
            instance.config = saved_config
        if len(fed) != 1 or output is not fed[0]:
            raise RuntimeError(
                "recompute-activation-function: megatron's MLP.forward no longer runs "
                "linear_fc1 -> activation -> linear_fc2 once each; switch the feature off"
            )
        return output

    return activation


@dataclass(frozen=True)
class MLPForward:
    """Wrapper of ``MLP.forward``."""

    recompute: Recompute

    def __call__(self, wrapped, instance, args, kwargs):
        if instance is None or not self.recompute.wanted(instance) or inside_whole_recompute():
            return wrapped(*args, **kwargs)
        call = Call(wrapped, args, kwargs)
        hidden_states, per_token_scale = call["hidden_states"], call.get("per_token_scale")
        reason = _unsupported(instance.config)
        if reason is None and per_token_scale is not None and getattr(instance.linear_fc2, "bias", None) is not None:
            reason = "per-token scale together with an fc2 bias"
        if reason is not None:
            self.recompute.fall_back(reason)
            return wrapped(*args, **kwargs)

        fc1_output, fc1_bias = instance.linear_fc1(hidden_states)
        checkpoint = self.recompute.checkpoint()
        activation = _megatron_activation(wrapped, instance, instance.config)
        intermediate = checkpoint.checkpoint(activation, fc1_output, fc1_bias, per_token_scale)
        output, output_bias = instance.linear_fc2(intermediate)
        if intermediate.numel() == 0:
            # an expert that received no tokens: nothing to free (empty tensors all report data
            # pointer 0, so the storage test below would misread this as shared storage)
            output.register_hook(checkpoint._recompute)
        elif intermediate.untyped_storage().data_ptr() == fc1_output.untyped_storage().data_ptr():
            # the activation returned (a view of) its input: freeing it would free fc1's output,
            # which the recompute needs. Nothing to save; still recompute so backward can run.
            self.recompute.fall_back("the activation output shares storage with fc1's output")
            output.register_hook(checkpoint._recompute)
        else:
            checkpoint.discard_output_and_register_recompute(output)
        return output, output_bias


@dataclass(frozen=True)
class GroupedMLPForward:
    """Wrapper of ``GroupedMLP.forward`` and ``TEGroupedMLP.forward`` (< 0.17): megatron's own
    moe_act recompute, switched on for the call (both classes read ``activation_recompute`` in
    forward the same way)."""

    recompute: Recompute

    def __call__(self, wrapped, instance, args, kwargs):
        if instance is None or instance.activation_recompute or not self.recompute.wanted(instance):
            return wrapped(*args, **kwargs)  # megatron's moe_act already recomputes: no double
        if inside_whole_recompute():
            return wrapped(*args, **kwargs)  # moe-zero-memory recomputes the whole experts call
        reason = _unsupported(instance.config)
        if reason is None and saved_tensor_hooks_active() and self.recompute.hook_safe:
            reason = (
                "saved-tensor hooks are active and this megatron-core's moe_act recompute loses gradients under them"
            )
        if reason is not None:
            self.recompute.fall_back(reason)
            return wrapped(*args, **kwargs)
        instance.activation_recompute = True
        try:
            return wrapped(*args, **kwargs)
        finally:
            instance.activation_recompute = False


@dataclass(frozen=True)
class UncoveredGroupedExperts:
    """Wrapper of ``TEGroupedMLP.forward`` on megatron-core 0.17+: says once that these experts keep
    their activation output. megatron's moe_act recompute there shares the recomputed storage
    through a C++ extension that g++ compiles at the first backward (see checkpoint.py), and its
    forward builds the checkpoint itself, so our copying subclass cannot be put in."""

    recompute: Recompute

    def __call__(self, wrapped, instance, args, kwargs):
        if instance is not None and not instance.activation_recompute and self.recompute.wanted(instance):
            self.recompute.fall_back(
                "TEGroupedMLP experts on megatron-core 0.17+ (megatron's own recompute of them compiles a C++ "
                "extension at the first backward: --recompute-granularity selective --recompute-modules moe_act "
                "asks megatron for it)"
            )
        return wrapped(*args, **kwargs)
